"""TAEF2's real weights on real photos, through the whole live path.

The checkpoint goes in with the real CLI (``python -m app import taesd``), a uvicorn server
serves the store, a photo from ``../shared/data`` is encoded with TAEF2's own encoder (test
code only), and the latent comes back over HTTP as PNG (diffusers' ``remote_decode``), JPEG
and WebP. The PNG must score >= 28 dB PSNR against the original photo; the lossy formats at
most a few dB below it. One photo, the smallest (the path is the same for any; every photo's
round trip is scored in-process: tests/test_taesd.py); its odd 451x300 size also checks that
the response is the padded latent's size, 456x304. Skips when ``../shared`` is absent (a
user's clone).
"""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import requests
import torch
import torch.nn.functional as F
from diffusers.utils.remote_utils import remote_decode
from PIL import Image

from tests.conftest import shared_path
from tests.helpers import psnr
from tests.live import cli_import, live_server
from tests.taef2_encoder import load_encoder

PHOTO = "chelsea.png"
PNG_MIN_DB = 28.0  # the in-process float round trip scores 29.6-32.7 dB on the photos
LOSSY_MAX_DROP_DB = 3.0  # JPEG/WebP at the service's default quality (90)
PHASES = ["parse", "clamp", "conv_in", "mid", "up_0", "up_1", "up_2", "conv_out", "encode"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> str:
    """The real checkpoint imported by the CLI into a fresh store, served on loopback."""
    weights = shared_path("weights", "taef2", "taef2_decoder.pth")
    store = tmp_path_factory.mktemp("taef2-store")
    (stdout,) = cli_import(store, ("taesd", weights, "taef2"))
    print(stdout.strip())
    assert (store / "taef2").is_dir()
    with live_server(store, default_model="taef2") as url:
        ready = requests.get(f"{url}/readyz", timeout=5)
        assert ready.status_code == 200, ready.text
        yield url


@pytest.fixture(scope="module")
def photo() -> tuple[np.ndarray, torch.Tensor]:
    """The original uint8 HxWx3 and the TAEF2 latent of the photo replicate-padded to 8x."""
    encoder = load_encoder(shared_path("weights", "taef2", "taef2_encoder.pth"))
    img = np.array(Image.open(shared_path("data", PHOTO)).convert("RGB"))
    x = torch.from_numpy(img).permute(2, 0, 1)[None].float() / 255
    h, w = x.shape[-2:]
    x = F.pad(x, (0, -w % 8, 0, -h % 8), mode="replicate")
    with torch.no_grad():
        return img, encoder(x).contiguous()


def _crop_score(image: Image.Image, img: np.ndarray, z: torch.Tensor) -> float:
    """The decoded image is the padded latent's size; crop back and score the whole photo."""
    assert image.size == (z.shape[-1] * 8, z.shape[-2] * 8)
    h, w = img.shape[:2]
    return psnr(np.asarray(image.convert("RGB"))[:h, :w], img)


def _post(url: str, z: torch.Tensor, params: dict, headers: dict | None = None):
    r = requests.post(
        url,
        data=z.numpy().astype("<f4").tobytes(),
        params={"shape": list(z.shape), "dtype": "float32", **params},
        headers={"Content-Type": "tensor/binary", **(headers or {})},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r


def test_real_photo_through_http(server, photo) -> None:
    img, z = photo
    h, w = img.shape[:2]
    # PNG through diffusers' own client, exactly as a sampler would call it.
    png = remote_decode(
        f"{server}/decode/taef2", z, do_scaling=False, output_type="pil", image_format="png"
    )
    assert png.format.lower() == "png"
    png_db = _crop_score(png, img, z)

    # JPEG by image_format, WebP by the Accept header; raw tensor bytes plus shape either way.
    scores = {"png": png_db}
    lossy = (
        ("jpg", {"output_type": "pil", "image_format": "jpg"}, None, "JPEG"),
        ("webp", {"output_type": "pil"}, {"Accept": "image/webp"}, "WEBP"),
    )
    for fmt, params, headers, pil_name in lossy:
        r = _post(f"{server}/decode/taef2", z, params, headers)
        assert r.headers["content-type"] == {"jpg": "image/jpeg", "webp": "image/webp"}[fmt]
        timing = r.headers["Server-Timing"]
        for phase in PHASES:
            assert f"{phase};dur=" in timing, (phase, timing)
        image = Image.open(io.BytesIO(r.content))
        assert image.format == pil_name
        scores[fmt] = _crop_score(image, img, z)
    print(f"{PHOTO} {w}x{h} via HTTP: " + ", ".join(f"{k} {v:.2f} dB" for k, v in scores.items()))
    assert png_db >= PNG_MIN_DB
    for fmt in set(scores) - {"png"}:
        assert scores[fmt] >= png_db - LOSSY_MAX_DROP_DB, (fmt, scores)


def test_models_preview_hint_and_metrics(server) -> None:
    # One small decode of its own, so this test also stands alone (-k).
    z = torch.randn(1, 32, 4, 4, generator=torch.Generator().manual_seed(0))
    _post(f"{server}/decode/taef2", z, {"output_type": "pt"})
    models = {m["name"]: m for m in requests.get(f"{server}/models", timeout=5).json()["models"]}
    taef2 = models["taef2"]
    print(f"taef2 served on {taef2['device']}/{taef2['dtype']}, gate {taef2['parity_cosine']:.7f}")
    assert taef2["family"] == "taesd" and taef2["store_dtype"] == "float16"
    assert taef2["config"]["preview"] is True and taef2["config"]["variant"] == "taef2"
    assert taef2["fallback"] is False and taef2["parity_cosine"] >= 0.9999

    text = requests.get(f"{server}/metrics", timeout=5).text
    seen = {
        m.group(1)
        for m in re.finditer(r'^vae_phase_seconds_count\{[^}]*phase="([^"]+)"[^}]*\}', text, re.M)
        if 'model="taef2"' in m.group(0)
    }
    missing = set(PHASES) - {"encode"} - seen  # a pt response has no image encode
    assert not missing, f"phases without a vae_phase_seconds series for taef2: {missing}"
