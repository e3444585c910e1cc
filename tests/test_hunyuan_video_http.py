"""The hunyuan-video family through a real uvicorn server on loopback, with diffusers' own
``remote_decode`` as the client, called as diffusers' remote-VAE tests call the HunyuanVideo
endpoint (a float16 ``[1,16,3,h,w]`` latent, ``scaling_factor=0.476986``, ``VideoProcessor``;
``output_type`` "pt" and "mp4"), and diffusers' decode of the same weights as the oracle.

A tiny random ``AutoencoderKLHunyuanVideo`` is ``save_pretrained`` and imported with the real
CLI (``python -m app import hunyuan-video FOLDER --name hy``), then served in float32 on CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLHunyuanVideo
from diffusers.utils.remote_utils import remote_decode
from diffusers.video_processor import VideoProcessor
from PIL import Image

from tests.helpers import cosine, read_mp4, seeded
from tests.live import import_pretrained, live_server

SCALE = 0.476986
H, W = 5, 8  # latent cells: 40x64 pixels
pytestmark = pytest.mark.filterwarnings("ignore:`do_scaling` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(endpoint URL, diffusers oracle): the tiny VAE imported by the CLI, then served."""
    store = tmp_path_factory.mktemp("hunyuan") / "store"
    oracle = seeded(
        AutoencoderKLHunyuanVideo,
        40,
        latent_channels=16,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        norm_num_groups=4,
    )
    import_pretrained(store, "hunyuan-video", {"hy": oracle})
    with live_server(store, dtype="float32", device="cpu") as url:
        yield f"{url}/decode/hy", oracle


def latent(t: int = 3, seed: int = 1) -> torch.Tensor:
    """The endpoint tests' latent, in miniature: float16 ``[1,16,t,5,8]``."""
    z = torch.randn((1, 16, t, H, W), generator=torch.Generator().manual_seed(seed))
    return z.to(torch.float16)


def expected(oracle: AutoencoderKLHunyuanVideo, z: torch.Tensor) -> torch.Tensor:
    """What the endpoint should return: diffusers' default decode of ``z / scaling_factor``."""
    with torch.no_grad():
        return oracle.decode(z.float() / SCALE).sample


@pytest.mark.parametrize("t", [3, 6], ids=["one-pass", "windowed"])
def test_output_type_pt_return_type_pt(world, t):
    url, oracle = world
    z = latent(t)
    got = remote_decode(url, z, scaling_factor=SCALE, output_type="pt", return_type="pt")
    want = expected(oracle, z)
    assert got.shape == want.shape == (1, 3, 1 + 4 * (t - 1), 8 * H, 8 * W)
    assert got.dtype == torch.float16  # the latent's dtype, as the endpoint returns it
    assert cosine(got, want) >= 0.99999


def test_output_type_pt_with_video_processor(world):
    """``output_type="pt"`` + ``VideoProcessor``: the frames diffusers' processor makes."""
    url, oracle = world
    z = latent(seed=2)
    frames = remote_decode(
        url, z, scaling_factor=SCALE, output_type="pt", processor=VideoProcessor()
    )
    assert isinstance(frames, list) and len(frames) == 9
    assert isinstance(frames[0], Image.Image) and frames[0].size == (8 * W, 8 * H)
    want = VideoProcessor().postprocess_video(expected(oracle, z), output_type="pil")[0]
    for got, ref in zip(frames, want, strict=True):
        assert np.abs(np.asarray(got).astype(int) - np.asarray(ref).astype(int)).max() <= 1


def test_output_type_pil_with_video_processor(world):
    url, oracle = world
    z = latent(seed=3)
    frames = remote_decode(
        url, z, scaling_factor=SCALE, output_type="pil", processor=VideoProcessor()
    )
    assert len(frames) == 9 and frames[0].size == (8 * W, 8 * H)
    got = np.stack([np.asarray(f) for f in frames]).astype(float).ravel()
    assert np.abs(got - _unit8(expected(oracle, z))).max() <= 1


def test_partial_postprocess_frames(world):
    url, oracle = world
    z = latent(seed=4)
    frames = remote_decode(url, z, scaling_factor=SCALE, output_type="pt", partial_postprocess=True)
    assert len(frames) == 9 and frames[0].size == (8 * W, 8 * H)
    got = np.stack([np.asarray(f) for f in frames]).astype(float).ravel()
    assert np.abs(got - _unit8(expected(oracle, z))).max() <= 1


@pytest.mark.parametrize("t", [3, 6], ids=["one-pass", "windowed"])
def test_output_type_mp4(world, t, tmp_path):
    url, oracle = world
    z = latent(t, seed=5)
    data = remote_decode(url, z, scaling_factor=SCALE, output_type="mp4", return_type="mp4")
    assert isinstance(data, bytes)
    meta, frames = read_mp4(data, tmp_path)
    assert meta["size"] == (8 * W, 8 * H) and meta["fps"] == 24
    assert len(frames) == 1 + 4 * (t - 1)
    # H.264 (yuv420) is lossy on random-weight noise: the frames correlate with the oracle's,
    # not with another latent's
    got = frames.astype(float).ravel()
    want, other = (_unit8(expected(oracle, x)) for x in (z, latent(t, seed=50)))
    same, different = np.corrcoef(got, want)[0, 1], np.corrcoef(got, other)[0, 1]
    print(f"mp4 T={t}: correlation {same:.3f} with the oracle, {different:.3f} with another")
    assert same > 0.9 and different < 0.5


def _unit8(decoded: torch.Tensor) -> np.ndarray:
    """[1,3,T,H,W] in [-1, 1] -> [T,H,W,3] uint8-range floats, flattened."""
    frames = decoded[0].permute(1, 2, 3, 0)
    return ((frames / 2 + 0.5).clamp(0, 1) * 255).round().numpy().ravel()


def test_do_scaling_divides_by_the_scaling_factor(world):
    """``do_scaling`` without factors: HunyuanVideoPipeline's ``z / scaling_factor``."""
    url, oracle = world
    z = latent(seed=6)
    got = remote_decode(url, z, do_scaling=True, output_type="pt", return_type="pt")
    assert cosine(got, expected(oracle, z)) >= 0.99999
    unscaled = remote_decode(url, z, do_scaling=False, output_type="pt", return_type="pt")
    assert cosine(unscaled, expected(oracle, z)) < 0.9999  # the scaling is really applied
