"""PNG encoding split across cores, for images whose encode would outlast their GPU decode.

Pillow's encoder is one thread per image: a 1024x1024 PNG takes longer to encode than a GPU
takes to decode it. PNG's pixel data is one zlib stream, but a deflate stream may be cut
into pieces compressed independently and concatenated, each non-final piece ending on a
sync flush (as pigz does); zlib releases the GIL while it compresses, so the pieces run in
parallel threads. Rows use PNG's "Sub" filter (each byte minus the one a pixel to its left),
computed with numpy. Any PNG reader decodes the result; tests/test_media.py checks it
against Pillow's.
"""

from __future__ import annotations

import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"
SUB = 1  # PNG filter type
MIN_PIECE_BYTES = 256 << 10  # smaller pieces cost more in ratio than they save in time
_pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="png")


def encode_png(rgb: np.ndarray, level: int = 1) -> bytes:
    """uint8 ``[H, W, 3]`` -> PNG bytes (8-bit RGB, no interlace)."""
    height, width, _ = rgb.shape
    raw = _filtered_rows(np.ascontiguousarray(rgb)).reshape(-1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = _zlib_parallel(memoryview(raw), level, height)
    return SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")


def _filtered_rows(rgb: np.ndarray) -> np.ndarray:
    """Each row as its filter byte, then the row's bytes minus the pixel to their left."""
    height = rgb.shape[0]
    rows = rgb.reshape(height, -1)
    out = np.empty((height, rows.shape[1] + 1), np.uint8)
    out[:, 0] = SUB
    out[:, 1:4] = rows[:, :3]
    np.subtract(rows[:, 3:], rows[:, :-3], out=out[:, 4:])  # uint8: wraps mod 256, as PNG does
    return out


def _zlib_parallel(raw: memoryview, level: int, rows: int) -> bytes:
    """A zlib stream of ``raw``, deflated in pieces on the thread pool."""
    pieces = max(1, min(_pool._max_workers, len(raw) // MIN_PIECE_BYTES, rows))
    step = -(-len(raw) // pieces)
    parts = [raw[i : i + step] for i in range(0, len(raw), step)]
    last = len(parts) - 1
    deflated = _pool.map(lambda item: _deflate(item[1], level, item[0] == last), enumerate(parts))
    header = b"\x78\x01"  # deflate, 32 KiB window, no preset dictionary
    return header + b"".join(deflated) + struct.pack(">I", zlib.adler32(raw))


def _deflate(part: memoryview, level: int, final: bool) -> bytes:
    compressor = zlib.compressobj(level, zlib.DEFLATED, -15)  # raw deflate: no header
    out = compressor.compress(part)
    return out + compressor.flush(zlib.Z_FINISH if final else zlib.Z_SYNC_FLUSH)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
