"""Opening image files at a bounded cost, and the one set of rules that turns any Pillow
image into pixels: the only place the serving side (the HTTP API, the web app and
``Classifier``) turns bytes, a path or a Pillow image into an array (``pixels``).

What an untrusted file can make the server spend is fixed before its pixels exist:

- only formats whose header states the size of what will be decoded are opened
  (``FORMATS``); container formats that hold several images and whose header can lie about
  them (ICO, CUR, ICNS, ...) and formats that run other programs (EPS) are refused;
- the size from the header is checked against ``MAX_PIXELS`` before decoding, the file is
  verified and reopened, and a decoded frame must have the size its header stated;
- large JPEGs are decoded at a reduced scale (``Image.draft``) and every image wider or
  taller than ``WORKING_SIDE`` pixels is box-reduced by an integer factor before it is
  turned into floats (the models see 56x56 pixels; ``shrink``).

So one image costs at most ``MAX_PIXELS`` x 4 bytes while it is decoded (160 MB) and a few
MB after that, whatever its dimensions.

``pixels`` reads every mode the same way for all of them: 1-bit and 8-bit grey /255, 16-bit
and 32-bit integer grey /65535 (clipped), float grey clipped to [0, 1] (NaN or infinity
refused), palette, CMYK, YCbCr, LAB and HSV through RGB, and transparency flattened onto a
given background (black, the models' training background, unless the caller inverts).
"""

from __future__ import annotations

import io
import math
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

__all__ = [
    "FORMATS",
    "MAX_PIXELS",
    "WORKING_SIDE",
    "ImageError",
    "check_size",
    "open_image",
    "pixels",
    "shrink",
]

MAX_PIXELS = 40_000_000  # per image: larger ones are refused before their pixels are decoded
WORKING_SIDE = 1024  # images larger than this on a side are reduced before anything else
# Pillow's names of the accepted formats (JPEG includes MPO): each header states the
# decoded size
FORMATS = ("PNG", "JPEG", "GIF", "BMP", "DIB", "TIFF", "WEBP", "PPM", "TGA")
Image.init()  # every plugin registered, so that formats= finds each of FORMATS
_SHOWN = "PNG, JPEG, GIF, BMP, TIFF, WebP, PNM or TGA"


class ImageError(ValueError):
    """A file that cannot be classified; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def open_image(source: bytes | str | Path) -> Image.Image:
    """Open, bound, verify and decode the first frame of an image file (bytes or a path).

    The result is loaded, EXIF-rotated and at most ``WORKING_SIDE`` pixels on a side for
    JPEGs (their decoder reduces by powers of two; other formats are reduced later by
    ``shrink``). Raises ``ImageError``: 415 not an accepted format, 413 over
    ``MAX_PIXELS``, 422 damaged, truncated or inconsistent.
    """
    what = "the image" if isinstance(source, bytes) else f"the file {source}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with _open(source) as probe:
                check_size(*probe.size)
                probe.verify()
            image = _open(source)
            image.seek(0)
            if image.format in ("JPEG", "MPO"):
                image.draft(image.mode, (WORKING_SIDE, WORKING_SIDE))
            expected = image.size
            image.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageError(413, f"{what} is over the {_limit()} megapixel limit ({err})") from None
    except Exception as err:  # Pillow raises many types for damaged files
        raise ImageError(422, f"{what} is damaged or truncated ({err})") from None
    if image.size != expected:
        raise ImageError(
            422, f"{what} decodes to {image.size}, not the {expected} its header states"
        )
    return ImageOps.exif_transpose(image)


def _open(source: bytes | str | Path) -> Image.Image:
    """The header only, of an accepted format."""
    what = "the file is" if isinstance(source, bytes) else f"cannot read {source}:"
    try:
        if isinstance(source, bytes):
            return Image.open(io.BytesIO(source), formats=FORMATS)
        return Image.open(Path(source), formats=FORMATS)
    except FileNotFoundError:
        raise ImageError(422, f"cannot read {source}: no such file") from None
    except UnidentifiedImageError:
        raise ImageError(415, f"{what} not an image in an accepted format ({_SHOWN})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageError(413, f"{what} over the {_limit()} megapixel limit ({err})") from None
    except Exception as err:
        raise ImageError(422, f"{what} an image with a damaged header ({err})") from None


def check_size(width: int, height: int) -> None:
    """Refuse an image without pixels (422) or over ``MAX_PIXELS`` (413)."""
    if width < 1 or height < 1:
        raise ImageError(422, f"the image has no pixels ({width}x{height})")
    if width * height > MAX_PIXELS:
        raise ImageError(
            413,
            f"the image has {width}x{height} = {width * height / 1e6:.1f} megapixels, over "
            f"the {_limit()} megapixel limit (serve.MAX_PIXELS): downscale it first",
        )


def shrink(image: Image.Image, side: int = WORKING_SIDE) -> Image.Image:
    """Box-reduce ``image`` by the smallest integer factor that brings both sides to at
    most ``side`` pixels (unchanged when they already are). Modes L, RGB, I, F (16-bit
    grey becomes I, 1-bit L); transparency must have been flattened before."""
    factor = math.ceil(max(image.size) / side)
    if factor <= 1:
        return image
    if image.mode.startswith("I;16"):
        image = image.convert("I")
    elif image.mode == "1":
        image = image.convert("L")
    return image.reduce(factor)


_GREY_INT = ("I", "I;16", "I;16L", "I;16B", "I;16N")
_ALPHA = ("RGBA", "RGBa", "LA", "La", "PA")


def pixels(image: Image.Image, *, background: int = 0) -> np.ndarray:
    """A Pillow image of any mode -> float32 ``[H, W]`` (grey) or ``[H, W, 3]`` (colour) in
    [0, 1], transparency flattened onto ``background`` (0 black, 255 white), at most
    ``WORKING_SIDE`` pixels on a side (``shrink``). Raises ``ImageError`` (422) for NaN or
    infinite float pixels."""
    mode = image.mode
    if mode in _GREY_INT:
        return np.clip(np.asarray(shrink(image), dtype=np.float32), 0, 65535) / 65535.0
    if mode == "F":
        values = np.asarray(shrink(image), dtype=np.float32)
        if not np.isfinite(values).all():
            raise ImageError(422, "the image holds NaN or infinite values")
        return np.clip(values, 0.0, 1.0)
    if mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    elif mode == "1":
        image = image.convert("L")
    if image.mode in _ALPHA:
        colour = "L" if image.mode in ("LA", "La") else "RGB"
        flat = Image.new(colour, image.size, (background,) * len(colour))
        flat.paste(image.convert(colour), mask=image.getchannel("A"))
        image = flat
    if image.mode not in ("L", "RGB"):
        image = image.convert("RGB")
    return np.asarray(shrink(image), dtype=np.float32) / 255.0


def _limit() -> str:
    return f"{MAX_PIXELS / 1e6:g}"
