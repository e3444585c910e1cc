"""The wan family through a real uvicorn server on loopback, with diffusers' own
``remote_decode`` as the client and diffusers' decode of the same weights as the oracle.

Three tiny random diffusers VAEs are ``save_pretrained`` and imported with the real CLI
(``python -m app import wan FOLDER --name ...``): Wan 2.1, Wan 2.2 TI2V (48 channels, 2x2
patch, residual up blocks) and Qwen-Image's ``AutoencoderKLQwenImage``.
"""

from __future__ import annotations

import io
from functools import partial

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils.remote_utils import remote_decode
from PIL import Image

from tests import helpers
from tests.helpers import cosine, read_mp4, seeded
from tests.live import import_pretrained, live_server

_SMALL = dict(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
MODELS = {
    "wan21": (AutoencoderKLWan, dict(_SMALL, z_dim=16)),
    "wan22": (
        AutoencoderKLWan,
        dict(
            _SMALL,
            z_dim=48,
            **helpers.WAN22_PATCHED,
            scale_factor_spatial=16,
            latents_mean=[0.1] * 48,
            latents_std=[0.8] * 48,
        ),
    ),  # fmt: skip
    "qwen": (AutoencoderKLQwenImage, dict(_SMALL, z_dim=16)),
}
pytestmark = pytest.mark.filterwarnings("ignore:`do_scaling` is deprecated:FutureWarning")
latent = partial(helpers.latent, seed=1)  # seed 1 unless a test says otherwise


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(base URL, {name: diffusers oracle}): every model imported by the CLI, then served."""
    store = tmp_path_factory.mktemp("wan") / "store"
    oracles = {
        name: seeded(cls, 30 + i, **kwargs)
        for i, (name, (cls, kwargs)) in enumerate(MODELS.items())
    }
    import_pretrained(store, "wan", oracles)
    with live_server(store, dtype="float32", device="cpu") as url:
        yield url, oracles


def test_qwen_image_single_frame_pil(world):
    """Qwen-Image's 5-D single-frame latent -> one PNG, as diffusers' image processor
    would make it from diffusers' decode."""
    url, oracles = world
    z = latent(1, 16, 1, 4, 5)
    image = remote_decode(
        f"{url}/decode/qwen", z, output_type="pil", image_format="png", do_scaling=False
    )
    assert image.size == (40, 32)
    with torch.no_grad():
        decoded = oracles["qwen"].decode(z).sample[:, :, 0]
    expected = np.asarray(VaeImageProcessor().postprocess(decoded, output_type="pil")[0])
    assert np.abs(np.asarray(image).astype(int) - expected).max() <= 1


@pytest.mark.parametrize("name", ["wan21", "wan22"])
def test_video_pt_matches_diffusers(world, name):
    url, oracles = world
    c = oracles[name].config.z_dim
    z = latent(1, c, 3, 2, 3, seed=2)
    got = remote_decode(
        f"{url}/decode/{name}", z, output_type="pt", return_type="pt", do_scaling=False
    )
    with torch.no_grad():
        expected = oracles[name].decode(z).sample
    assert got.shape == expected.shape == (1, 3, 9) + expected.shape[-2:]
    assert cosine(got, expected) >= 0.99999


@pytest.mark.parametrize("name", ["wan21", "wan22", "qwen"])
def test_do_scaling_uses_the_latent_statistics(world, name):
    """``do_scaling`` without factors: WanPipeline's ``z / (1/std) + mean`` before decoding."""
    url, oracles = world
    vae = oracles[name]
    z = latent(1, vae.config.z_dim, 2, 2, 2, seed=3)
    got = remote_decode(f"{url}/decode/{name}", z, output_type="pt", return_type="pt")
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        expected = vae.decode(z * std + mean).sample
    assert cosine(got, expected) >= 0.99999


@pytest.mark.parametrize("name", ["wan21", "wan22"])
def test_remote_decode_mp4(world, name, tmp_path):
    url, oracles = world
    z = latent(1, oracles[name].config.z_dim, 3, 2, 2, seed=4)
    data = remote_decode(
        f"{url}/decode/{name}", z, output_type="mp4", return_type="mp4", do_scaling=False
    )
    meta, frames = read_mp4(data, tmp_path)
    side = 2 * (8 if name == "wan21" else 16)
    assert meta["size"] == (side, side)
    assert len(frames) == 9  # 1 + 4 * (3 - 1)
    assert meta["fps"] == (16 if name == "wan21" else 24)


def test_models_lists_the_variants(world):
    import requests

    url, _ = world
    models = {m["name"]: m for m in requests.get(f"{url}/models", timeout=10).json()["models"]}
    assert {n: models[n]["config"]["variant"] for n in MODELS} == {
        "wan21": "wan2.1",
        "wan22": "wan2.2",
        "qwen": "qwen-image",
    }
    assert all(models[n]["family"] == "wan" for n in MODELS)


def test_image_bytes_are_png(world):
    url, _ = world
    image = remote_decode(
        f"{url}/decode/qwen", latent(1, 16, 1, 2, 2), output_type="pil", image_format="png"
    )
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    assert Image.open(buffer).size == (16, 16)
