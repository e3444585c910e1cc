"""LTX-2 through a real uvicorn server on loopback, with diffusers' ``remote_decode``.

A tiny random ``AutoencoderKLLTX2Video`` (reflect padding, a spatial, a temporal and a
spatiotemporal upsampler, causal, timestep conditioning, noise, non-trivial latent stats) is
``save_pretrained`` and imported with the real CLI (``python -m app import ltx``); diffusers'
decode of the same latent with the same weights is the oracle.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import requests
import torch
from diffusers import AutoencoderKLLTX2Video
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline
from diffusers.utils.remote_utils import remote_decode

from tests.helpers import check, latent, psnr
from tests.live import live_server
from tests.test_ltx2 import ENCODER, LATENT_CHANNELS, VARIANTS
from tests.test_ltx_http import (
    MIN_PSNR,
    ROOT,
    diffusers_frames,
    post,
    probe,
    read_mp4,
    smooth_head,
    tensor_of,
)

C = LATENT_CHANNELS
NAME = "ltx2-kinds"
pytestmark = pytest.mark.filterwarnings("ignore:`do_scaling` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("ltx2")
    vae = reference()
    vae.save_pretrained(tmp / NAME / "vae")
    command = [sys.executable, "-m", "app", "import", "ltx", str(tmp / NAME), "--name", NAME]
    command += ["--models-dir", str(tmp / "store")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    with live_server(tmp / "store", dtype="float32", device="cpu") as url:
        yield f"{url}/decode/{NAME}", url, vae
    torch.set_num_threads(threads)


@torch.no_grad()
def reference() -> AutoencoderKLLTX2Video:
    torch.manual_seed(30)
    vae = AutoencoderKLLTX2Video(latent_channels=C, **ENCODER, **VARIANTS["kinds-causal"]).eval()
    for name, p in vae.decoder.named_parameters():
        if "per_channel_scale" in name:
            p.normal_(0, 0.1)
    vae.latents_mean.normal_(0, 0.5)
    vae.latents_std.uniform_(0.5, 1.5)
    smooth_head(vae.decoder.conv_out.conv, vae.config.patch_size)
    return vae


def oracle(vae, z, timestep: float = 0.0, seed: int = 0, scaled: bool = False) -> torch.Tensor:
    if scaled:
        z = LTX2Pipeline._denormalize_latents(
            z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        )
    torch.manual_seed(seed)
    with torch.no_grad():
        return vae.decode(z, torch.full((z.shape[0],), timestep)).sample


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
    expected = diffusers_frames(oracle(vae, z, scaled=True))
    assert got.shape == expected.shape == (9, 48, 64, 3)  # 1 + 4 (T - 1) frames, 16 px/cell
    quality = psnr(got, expected)
    print(f"ltx2 remote_decode mp4: {quality:.1f} dB vs diffusers' uint8 frames")
    assert quality >= MIN_PSNR


def test_remote_decode_pt_and_timestep(world):
    endpoint, url, vae = world
    z = latent(2, C, 2, 2, 3, seed=5)
    got = remote_decode(endpoint, z, output_type="pt", return_type="pt")
    check("ltx2 remote_decode pt do_scaling", got, oracle(vae, z, scaled=True))
    r = post(url, NAME, z, output_type="pt", timestep=0.4, seed=9)
    out = tensor_of(r)
    assert out.shape == (2, 3, 5, 32, 48)
    check("ltx2 pt timestep=0.4 seed=9", out, oracle(vae, z, timestep=0.4, seed=9))
