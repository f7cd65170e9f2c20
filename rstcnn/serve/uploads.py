"""Decoding untrusted image uploads into arrays the classifiers accept.

Every upload goes through ``decode_image``: the byte size is bounded before anything is
read, and the file is opened by ``serve.images.open_image`` (accepted formats only, the
pixel count bounded from the header before any pixel is decoded, verified, at most
``WORKING_SIDE`` pixels on a side afterwards). The result is a float32 array in [0, 1],
``[H, W]`` (grey) or ``[H, W, 3]`` (colour):

- 1-bit, 8-bit and 16-bit grey (16-bit divided by 65535; 32-bit integer images are read as
  16-bit data and clipped; float images are clipped to [0, 1], and refused when they hold
  NaN or infinity);
- palette, CMYK, YCbCr, LAB and HSV images through RGB;
- transparency (RGBA, LA, palette with a transparent colour) is flattened onto the
  background the models were trained on: black (white for images to be inverted);
- ``invert=True`` returns ``1 - x``, for dark objects on a light background (the models
  were trained on light objects on black);
- the EXIF orientation is applied, and of an animation only the first frame is used.

Anything else raises ``UploadError`` with an HTTP status and a message for the user.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .images import MAX_PIXELS, ImageError, open_image, pixels

__all__ = ["MAX_UPLOAD_BYTES", "MAX_PIXELS", "UploadError", "decode_image", "read_uploaded"]

MAX_UPLOAD_BYTES = 20 * 1024 * 1024  # 20 MiB per uploaded file

UploadError = ImageError  # an upload that cannot be classified, with its HTTP status


def read_uploaded(
    path: str | os.PathLike, folders: Sequence[str | Path], limit: int = MAX_UPLOAD_BYTES
) -> bytes:
    """The bytes of a file the web page uploaded: ``path`` must resolve (symbolic links
    followed) inside one of ``folders`` before anything opens it, and be a regular file of
    at most ``limit`` bytes. Any other path gets the same 403, whether it exists or not."""
    refused = UploadError(
        403, "this file was not uploaded through the page: upload it again or pick a sample"
    )
    try:
        real = Path(os.path.realpath(os.fspath(path)))
        roots = [Path(os.path.realpath(folder)) for folder in folders]
    except (OSError, TypeError, ValueError):  # ValueError: a NUL byte in the path
        raise refused from None
    if not any(real.is_relative_to(root) for root in roots):
        raise refused
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        raise UploadError(422, "the uploaded file is gone: upload it again") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise refused
        if info.st_size > limit:
            raise UploadError(413, f"the file is larger than the {_mib(limit)} upload limit")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UploadError(413, f"the file is larger than the {_mib(limit)} upload limit")
    return data


def decode_image(data: bytes, *, invert: bool = False) -> np.ndarray:
    """Decode an uploaded image. bytes -> float32 ``[H, W]`` or ``[H, W, 3]`` in [0, 1],
    at most ``WORKING_SIDE`` pixels on a side (``serve.images``).

    ``invert``: the image shows a dark object on a light background: flatten transparency
    onto white and return ``1 - x``. Raises ``UploadError``.
    """
    if not data:
        raise UploadError(400, "the upload is empty: choose an image file (PNG, JPEG, ...)")
    if len(data) > MAX_UPLOAD_BYTES:
        raise UploadError(413, f"the file is larger than the {_mib(MAX_UPLOAD_BYTES)} upload limit")
    decoded = pixels(open_image(data), background=255 if invert else 0)
    return 1.0 - decoded if invert else decoded


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"
