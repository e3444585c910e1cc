"""PNG encoding (app/media/png.py): exact round trip on every backend, and the fallback to Pillow
when fpng's wheel is missing."""

from __future__ import annotations

import builtins
import io

import numpy as np
import pytest
from PIL import Image

from app.media import png


def _image(shape: tuple[int, int]) -> np.ndarray:
    rgb = np.random.default_rng(sum(shape)).integers(0, 256, (*shape, 3), dtype=np.uint8)
    rgb[: shape[0] // 2] //= 16  # a smooth half and a noisy half
    return rgb


def _decoded(data: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG" and image.mode == "RGB"
    return np.asarray(image)


@pytest.mark.parametrize("shape", [(1, 1), (17, 33), (512, 640), (1024, 1024)])
def test_png_round_trips_through_pillow(shape):
    rgb = _image(shape)
    assert np.array_equal(_decoded(png.encode_png(rgb)), rgb)


@pytest.mark.parametrize("name", list(png.BACKENDS))
def test_every_backend_round_trips_exactly(name):
    try:
        encode = png.BACKENDS[name]()
    except ImportError:
        pytest.skip(f"{name} is not installed")
    for shape in ((1, 1), (33, 17), (300, 451)):
        rgb = _image(shape)
        assert np.array_equal(_decoded(encode(rgb)), rgb), (name, shape)
    view = _image((64, 96))[:, ::2]  # a non-contiguous view, as a strided frame is
    assert np.array_equal(_decoded(encode(view)), view)


def test_fpng_is_chosen_when_installed():
    pytest.importorskip("fpng")
    assert png.BACKEND == "fpng"


def test_pillow_is_the_fallback_when_fpng_is_missing(monkeypatch):
    real_import = builtins.__import__

    def no_fpng(name, *args, **kwargs):
        if name == "fpng" or name.startswith("fpng."):
            raise ImportError("No module named 'fpng'", name="fpng")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fpng)
    name, encode = png.select_backend()
    assert name == "pillow"
    rgb = _image((40, 24))
    assert np.array_equal(_decoded(encode(rgb)), rgb)


def test_bad_arrays_are_refused():
    with pytest.raises(ValueError, match="uint8"):
        png.encode_png(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ValueError, match="uint8"):
        png.encode_png(np.zeros((4, 4, 4), np.uint8))
