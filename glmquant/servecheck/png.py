"""A byte-deterministic PNG encoder (stored deflate blocks, no compression).

Pillow's PNG bytes depend on the zlib its wheel bundles (zlib or zlib-ng, and their versions), so a
pinned SHA-256 of a Pillow-saved PNG breaks across machines. Stored blocks only need CRC-32 and
Adler-32, which are fixed functions, so these bytes are the same everywhere.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_MAX_STORED = 65535


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _zlib_stored(raw: bytes) -> bytes:
    """A zlib stream of uncompressed deflate blocks (RFC 1950/1951)."""
    out = bytearray(b"\x78\x01")
    for start in range(0, max(len(raw), 1), _MAX_STORED):
        block = raw[start : start + _MAX_STORED]
        final = 1 if start + _MAX_STORED >= len(raw) else 0
        out += bytes([final]) + struct.pack("<HH", len(block), len(block) ^ 0xFFFF) + block
    return bytes(out + struct.pack(">I", zlib.adler32(raw) & 0xFFFFFFFF))


def encode_png(rgb: np.ndarray) -> bytes:
    """PNG bytes of an 8-bit RGB image, array shape [H, W, 3]."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"encode_png needs uint8 [H, W, 3], got {rgb.dtype} {tuple(rgb.shape)}")
    height, width, _ = rgb.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), rgb.reshape(height, width * 3)], axis=1)  # filter 0
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return _SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", _zlib_stored(rows.tobytes())) + _chunk(b"IEND", b"")
