"""Crafted files an attacker would upload, small in bytes and costly if trusted; the soak
(``serve.loadtest``) and the tests send them. Each is made in memory from a few bytes of
header and a compressed run of zeros."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

__all__ = ["png_header", "png_zeros", "lying_ico", "lying_gif", "nan_tiff"]


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_zeros(width: int, height: int) -> bytes:
    """A valid black 8-bit grey PNG of ``width`` x ``height``: a 40,000,000 x 1 one is
    39 KB, a 13,000 x 13,000 one 165 KB."""
    packer = zlib.compressobj(9)
    row = bytes(width + 1)  # filter byte + pixels
    data = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", data)
        + _chunk(b"IEND", b"")
    )


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` grey pixels and holds a few bytes
    (a decompression bomb's header)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + _chunk(b"IEND", b"")
    )


def lying_ico(side: int = 13_000) -> bytes:
    """An ICO whose directory claims one 16x16 icon that is in fact a ``side`` x ``side``
    PNG (decoded, 169 MB at the default)."""
    inner = png_zeros(side, side)
    directory = struct.pack("<HHH", 0, 1, 1)
    entry = struct.pack("<BBBBHHII", 16, 16, 0, 0, 1, 32, len(inner), 6 + 16)
    return directory + entry + inner


def lying_gif(side: int = 8_000) -> bytes:
    """A GIF whose logical screen claims 16x16 pixels and whose first frame is ``side`` x
    ``side`` (Pillow reports the frame's extent at open, so the pixel limit still sees it)."""
    buffer = io.BytesIO()
    Image.new("L", (side, side)).save(buffer, format="GIF")
    data = bytearray(buffer.getvalue())
    data[6:10] = struct.pack("<HH", 16, 16)
    return bytes(data)


def nan_tiff() -> bytes:
    """A 32-bit float grey TIFF holding NaN."""
    pixels = np.full((56, 56), 0.5, np.float32)
    pixels[10:20, 10:20] = np.nan
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="TIFF")  # mode F
    return buffer.getvalue()
