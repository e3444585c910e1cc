"""The parallel PNG encoder: any reader decodes it to exactly the pixels given."""

from __future__ import annotations

import io
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from app import png


@pytest.mark.parametrize("shape", [(1, 1), (17, 33), (512, 640), (1024, 1024)])
def test_png_round_trips_through_pillow(shape):
    rgb = np.random.default_rng(sum(shape)).integers(0, 256, (*shape, 3), dtype=np.uint8)
    rgb[: shape[0] // 2] //= 16  # a smooth half, so pieces compress differently
    data = png.encode_png(rgb)
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG" and image.mode == "RGB"
    assert np.array_equal(np.asarray(image), rgb)


def test_a_large_image_is_deflated_in_several_pieces_into_one_stream(monkeypatch):
    monkeypatch.setattr(png, "MIN_PIECE_BYTES", 1 << 12)
    monkeypatch.setattr(png, "_pool", ThreadPoolExecutor(max_workers=4))
    pieces = []
    deflate = png._deflate
    monkeypatch.setattr(png, "_deflate", lambda *a: pieces.append(a) or deflate(*a))
    rgb = np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    raw = png._filtered_rows(rgb).tobytes()
    stream = png._zlib_parallel(memoryview(raw), 1, 256)
    assert len(pieces) == 4 and [final for *_, final in pieces].count(True) == 1
    assert zlib.decompress(stream) == raw  # one valid zlib stream, checksum included
