"""LTX-2 through a real uvicorn server on loopback, with diffusers' ``remote_decode``.

A tiny random ``AutoencoderKLLTX2Video`` (reflect padding, a spatial, a temporal and a
spatiotemporal upsampler, causal, timestep conditioning, noise, non-trivial latent stats) is
``save_pretrained`` and imported with the real CLI (``python -m app import ltx``); diffusers'
decode of the same latent with the same weights is the oracle.
"""

from __future__ import annotations

import re

import pytest
import requests
from diffusers import AutoencoderKLLTX2Video
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline
from diffusers.utils.remote_utils import remote_decode

from tests.helpers import (
    MP4_MIN_PSNR,
    check,
    diffusers_frames,
    latent,
    ltx_decode,
    probe,
    psnr,
    read_mp4,
    served_ltx,
)
from tests.live import import_pretrained, live_server, post, tensor_of
from tests.test_ltx2 import ENCODER, LATENT_CHANNELS, VARIANTS

C = LATENT_CHANNELS
NAME = "ltx2-kinds"
pytestmark = [
    pytest.mark.filterwarnings("ignore:`do_scaling` is deprecated:FutureWarning"),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(endpoint URL, base URL, diffusers oracle): the VAE imported by the CLI, then served."""
    store = tmp_path_factory.mktemp("ltx2") / "store"
    config = dict(latent_channels=C, **ENCODER, **VARIANTS["kinds-causal"])
    vae = served_ltx(AutoencoderKLLTX2Video, 30, **config)
    import_pretrained(store, "ltx", {NAME: vae})
    with live_server(store, dtype="float32", device="cpu") as url:
        yield f"{url}/decode/{NAME}", url, vae


def test_served_as_ltx2(world):
    _, url, _ = world
    (model,) = requests.get(f"{url}/models", timeout=5).json()["models"]
    assert model["family"] == "ltx" and not model["fallback"]
    assert model["config"]["version"] == "ltx2" and model["config"]["padding_mode"] == "reflect"
    assert model["parity_cosine"] >= 0.99999


def test_remote_decode_mp4(world, tmp_path):
    endpoint, _, vae = world
    z = latent(1, C, 3, 3, 4, seed=3)
    data = remote_decode(endpoint, z, output_type="mp4", return_type="mp4")
    assert isinstance(data, bytes) and data[4:8] == b"ftyp"
    assert re.search(r"Video: h264 .*yuv420p.*64x48.*25 fps", probe(data, tmp_path))
    _, got = read_mp4(data, tmp_path)
    expected = diffusers_frames(ltx_decode(vae, z, pipeline=LTX2Pipeline))
    assert got.shape == expected.shape == (9, 48, 64, 3)  # 1 + 4 (T - 1) frames, 16 px/cell
    quality = psnr(got, expected)
    print(f"ltx2 remote_decode mp4: {quality:.1f} dB vs diffusers' uint8 frames")
    assert quality >= MP4_MIN_PSNR


def test_remote_decode_pt_and_timestep(world):
    endpoint, url, vae = world
    z = latent(2, C, 2, 2, 3, seed=5)
    got = remote_decode(endpoint, z, output_type="pt", return_type="pt")
    check("ltx2 remote_decode pt do_scaling", got, ltx_decode(vae, z, pipeline=LTX2Pipeline))
    r = post(url, NAME, z, output_type="pt", timestep=0.4, seed=9)
    out = tensor_of(r)
    assert out.shape == (2, 3, 5, 32, 48)
    check("ltx2 pt timestep=0.4 seed=9", out, ltx_decode(vae, z, timestep=0.4, seed=9))
