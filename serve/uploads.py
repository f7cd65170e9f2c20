"""Decoding untrusted image uploads into arrays the classifiers accept.

Every upload goes through ``decode_image``: the byte size is bounded before anything is
decoded, the pixel count is read from the header and bounded before the pixels are, the
file is verified and then reopened (a verified Pillow image cannot be loaded), and the
result is a float32 array in [0, 1], ``[H, W]`` (grey) or ``[H, W, 3]`` (colour):

- 1-bit, 8-bit and 16-bit grey (16-bit divided by 65535; 32-bit integer images are read as
  16-bit data and clipped; float images are clipped to [0, 1]);
- palette, CMYK, YCbCr, LAB and HSV images through RGB;
- transparency (RGBA, LA, palette with a transparent colour) is flattened onto the
  background the models were trained on: black (white for images to be inverted);
- ``invert=True`` returns ``1 - x``, for dark objects on a light background (the models
  were trained on light objects on black);
- the EXIF orientation is applied, and of an animation only the first frame is used.

Anything else raises ``UploadError`` with an HTTP status and a message for the user.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from . import MAX_PIXELS

__all__ = ["MAX_UPLOAD_BYTES", "MAX_PIXELS", "UploadError", "decode_image", "read_file"]

MAX_UPLOAD_BYTES = 20 * 1024 * 1024  # 20 MiB per uploaded file

_GREY_16 = ("I;16", "I;16L", "I;16B", "I;16N")
_ALPHA = ("RGBA", "RGBa", "LA", "La", "PA")
_THROUGH_RGB = ("CMYK", "YCbCr", "LAB", "HSV", "RGBX")


class UploadError(ValueError):
    """An upload that cannot be classified; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def read_file(path: str, limit: int = MAX_UPLOAD_BYTES) -> bytes:
    """The bytes of an uploaded file, refusing files over ``limit`` bytes before reading."""
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UploadError(413, f"the file is larger than the {_mib(limit)} upload limit")
    return data


def decode_image(data: bytes, *, invert: bool = False) -> np.ndarray:
    """Decode an uploaded image. bytes -> float32 ``[H, W]`` or ``[H, W, 3]`` in [0, 1].

    ``invert``: the image shows a dark object on a light background: flatten transparency
    onto white and return ``1 - x``. Raises ``UploadError``.
    """
    if not data:
        raise UploadError(400, "the upload is empty: choose an image file (PNG, JPEG, ...)")
    if len(data) > MAX_UPLOAD_BYTES:
        raise UploadError(413, f"the file is larger than the {_mib(MAX_UPLOAD_BYTES)} upload limit")
    image = _open(data)
    width, height = image.size
    if width < 1 or height < 1:
        raise UploadError(422, f"the image has no pixels ({width}x{height})")
    if width * height > MAX_PIXELS:
        raise UploadError(
            413,
            f"the image has {width}x{height} = {width * height / 1e6:.1f} megapixels; "
            f"the limit is {MAX_PIXELS / 1e6:g} megapixels: downscale it first",
        )
    try:
        image.verify()
        image = _open(data)
        image.seek(0)
        image.load()
        image = ImageOps.exif_transpose(image)
    except UploadError:
        raise
    except Exception as err:  # Pillow raises many types for damaged files
        raise UploadError(422, f"the image file is damaged or truncated ({err})") from err
    pixels = _to_array(image, background=255 if invert else 0)
    return 1.0 - pixels if invert else pixels


def _open(data: bytes) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))  # reads the header only
    except UnidentifiedImageError as err:
        raise UploadError(
            415, "the file is not an image Pillow can read (PNG, JPEG, GIF, BMP, TIFF, WebP, ...)"
        ) from err
    except Image.DecompressionBombError as err:
        raise UploadError(
            413, f"the image is over the {MAX_PIXELS / 1e6:g} megapixel limit ({err})"
        ) from err
    except Exception as err:
        raise UploadError(422, f"the image header is damaged ({err})") from err


def _to_array(image: Image.Image, *, background: int) -> np.ndarray:
    """float32 [H, W] or [H, W, 3] in [0, 1], transparency flattened onto ``background``."""
    mode = image.mode
    if mode in _GREY_16:
        return np.asarray(image, dtype=np.float32) / 65535.0
    if mode == "I":
        return np.clip(np.asarray(image, dtype=np.float32), 0, 65535) / 65535.0
    if mode == "F":
        return np.clip(np.nan_to_num(np.asarray(image, dtype=np.float32)), 0.0, 1.0)
    if mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    elif mode in ("1", "L"):
        image = image.convert("L")
    elif mode in _THROUGH_RGB:
        image = image.convert("RGB")
    if image.mode in _ALPHA:
        colour = "L" if image.mode in ("LA", "La") else "RGB"
        flat = Image.new(colour, image.size, (background,) * len(colour))
        flat.paste(image.convert(colour), mask=image.getchannel("A"))
        image = flat
    if image.mode not in ("L", "RGB"):
        image = image.convert("RGB")
    return np.asarray(image, dtype=np.float32) / 255.0


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"
