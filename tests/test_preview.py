"""Latent-to-RGB previews (app/media/preview.py): shapes and dtype for every published format, and
a preview that looks like the real decode of a real latent (TAEF2's, of real photos)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from app.media.preview import FORMATS, preview
from app.media.preview_factors import FACTORS

SHARED = Path(__file__).resolve().parents[2] / "shared"
CHANNELS = {"sd1.5": 4, "sdxl": 4, "sd3": 16, "flux1": 16, "flux2": 32, "ltxv": 128,
            "wan2.1": 16, "hunyuan-video": 16}  # fmt: skip


def test_every_published_format_is_there_with_its_channel_count():
    assert set(FORMATS) == set(CHANNELS)
    for key, (factors, bias) in FACTORS.items():
        assert len(factors) == CHANNELS[key] and all(len(row) == 3 for row in factors), key
        assert bias is None or len(bias) == 3, key


@pytest.mark.parametrize("key", sorted(CHANNELS))
def test_shape_dtype_and_range(key):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, CHANNELS[key], 6, 10, generator=g)
    out = preview(key, z)
    assert out.shape == (2, 6, 10, 3) and out.dtype == np.uint8
    assert out.std() > 0  # not a constant image
    big = preview(key, z.numpy(), scale=8)  # numpy in, nearest upscale
    assert big.shape == (2, 48, 80, 3)
    assert np.array_equal(big[:, ::8, ::8], out) and np.array_equal(big[:, 7::8, 7::8], out)
    video = torch.randn(1, CHANNELS[key], 3, 4, 5, generator=g)
    assert preview(key, video).shape == (1, 4, 5, 3)  # the first latent frame, as ComfyUI
    frames = preview(key, video, frame=None)
    assert frames.shape == (1, 3, 4, 5, 3)
    assert np.array_equal(frames[:, 2], preview(key, video, frame=2))


def test_the_linear_map_is_the_published_one():
    """One latent pixel by hand: RGB = latent . factors + bias, then [-1, 1] -> 0..255."""
    factors, bias = FACTORS["flux1"]
    z = torch.linspace(-1, 1, 16).view(1, 16, 1, 1)
    rgb = np.array(factors).T @ np.linspace(-1, 1, 16) + np.array(bias)
    want = np.round((np.clip(rgb, -1, 1) + 1) * 127.5).astype(np.uint8)
    assert np.array_equal(preview("flux1", z)[0, 0, 0], want)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no published preview factors"):
        preview("sd9", torch.zeros(1, 4, 2, 2))
    with pytest.raises(ValueError, match="16 channels, got 4"):
        preview("flux1", torch.zeros(1, 4, 2, 2))
    with pytest.raises(ValueError, match="latent"):
        preview("flux1", torch.zeros(16, 2, 2))
    with pytest.raises(ValueError, match="floating-point"):
        preview("flux1", torch.zeros(1, 16, 2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="out of range"):
        preview("wan2.1", torch.zeros(1, 16, 2, 2, 2), frame=2)


def test_milliseconds_for_a_1024px_flux_latent():
    z = torch.randn(1, 16, 128, 128)
    preview("flux1", z)
    start = time.perf_counter()
    for _ in range(5):
        preview("flux1", z)
    per_call = (time.perf_counter() - start) / 5
    assert per_call < 0.25, per_call  # a few ms on an idle core; loose for a shared CI host


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(np.corrcoef(a, b)[0, 1])


@pytest.mark.parametrize("photo", ["astronaut.png", "coffee.png"])
def test_flux2_preview_correlates_with_the_photo(photo):
    """A real FLUX.2 latent (TAEF2's trained encoder on a photo): the preview, at latent
    resolution, must look like the photo the latent holds (TAEF2's trained decoder gives it
    back at 28 dB or more: tests/test_encoder_taesd.py)."""
    weights = SHARED / "weights" / "taef2"
    if not (weights / "taef2_encoder.pth").exists():
        pytest.skip("../shared/weights/taef2 is absent (a user's clone has none)")
    from tests.taef2_encoder import load_encoder

    encoder = load_encoder(weights / "taef2_encoder.pth")
    img = np.array(Image.open(SHARED / "data" / photo).convert("RGB"))
    h, w = (s - s % 8 for s in img.shape[:2])
    x = torch.from_numpy(img[:h, :w]).permute(2, 0, 1)[None].float() / 255
    with torch.no_grad():
        z = encoder(x)
    small = F.avg_pool2d(x, 8)[0].permute(1, 2, 0).numpy() * 255  # latent resolution
    approx = preview("flux2", z)[0]
    assert approx.shape == small.shape
    luma = [0.299, 0.587, 0.114]
    assert _pearson(approx @ luma, small @ luma) > 0.8
    for channel in range(3):
        assert _pearson(approx[..., channel], small[..., channel]) > 0.6, channel
    # and not by accident: another photo's decode does not correlate as well
    shuffled = np.roll(small, small.shape[0] // 2, axis=0)
    assert _pearson(approx @ luma, shuffled @ luma) < 0.5


EXPECTED_FORMAT = {  # the default store's synthetic models (their real configs' families)
    "flux1-synthetic": "flux1", "hunyuan-video-tiny": "hunyuan-video", "ltx-tiny": "ltxv",
    "ltx2-tiny": None, "wan2.1-tiny": "wan2.1", "qwen-image-tiny": "wan2.1",
    "wan2.2-tiny": None, "minimax-h3-tiny": None, "minimax-h3-image-tiny": None,
}  # fmt: skip


def test_each_served_family_maps_to_its_published_format_or_none():
    from app.families import PACKAGES, family, key_of
    from app.http.preview import preview_format

    seen = {}
    for key in (key_of(package) for package in PACKAGES):  # every family of the service
        described = family(key)
        for name, recipe in described.baked().items():
            decoder = described.decoder.module(recipe.config)
            seen[name] = preview_format(key, decoder.config, decoder.latent_channels)
    assert seen == EXPECTED_FORMAT
    sdxl = {"latent_channels": 4, "scaling_factor": 0.13025}
    assert preview_format("flux", sdxl, 4) == "sdxl"
    assert preview_format("flux", {"scaling_factor": 0.18215}, 4) == "sd1.5"
    assert preview_format("flux", {"scaling_factor": 1.5305, "shift_factor": 0.0609}, 16) == "sd3"
    assert preview_format("flux", {"latent_bn": True}, 32) == "flux2"
    assert preview_format("taesd", {"variant": "taef1"}, 16) == "flux1"
    assert preview_format("wan", {"preview_format": "sd3"}, 16) == "sd3"  # the manifest's wins
