"""MiniMax-H3 through a real uvicorn server on loopback.

Three store entries: a video model imported with ``python -m app import`` from a diffusers
folder (``save_pretrained`` of a tiny random ``AutoencoderKLMiniMaxH3``), a second one converted
from the seed's fused ``vvae.*`` single file (per-head interleaved ``to_qkv``), and the image
variant baked from ``SYNTHETIC``. diffusers' own ``remote_decode`` is the caller wherever it
can be; diffusers' ``AutoencoderKLMiniMaxH3`` with the same weights (tiling on, as released)
is the oracle for what comes back.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from diffusers import AutoencoderKLMiniMaxH3
from diffusers.utils.remote_utils import remote_decode
from diffusers.video_processor import VideoProcessor
from PIL import Image

from app.families.decoder import IMAGENET_MEAN, IMAGENET_STD
from app.families.minimax_h3 import decoder as mm
from app.families.minimax_h3.decoder.convert import config_from_diffusers
from app.families.minimax_h3.decoder.schedule import clip_plan, split_tiles
from app.media import mp4
from app.store import load_model, write_model
from tests import helpers
from tests.helpers import MP4_MIN_PSNR, latent, psnr, read_mp4
from tests.live import bake, import_pretrained, live_server, post, tensor_of, timed_phases
from tests.test_minimax_h3 import C, SeedImageRope, original_file, reference

# pt answers against the oracle: same shape, float32 on the wire, cos >= 0.99999
check = partial(helpers.check, dtype=torch.float32)

# remote_decode's default do_scaling=True (used on purpose below) warns of its deprecation
pytestmark = pytest.mark.filterwarnings("ignore:`do_scaling` is deprecated:FutureWarning")

KEEP = ("decoder.", "post_quant_conv.")
SAME_PSNR = 45.0  # dB: the service's MP4 against the same frames encoded here (near identical)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The store (three MiniMax-H3 entries), the live server, and one oracle per entry."""
    tmp = tmp_path_factory.mktemp("minimax")
    store = tmp / "store"

    # 1. diffusers layout, imported by the CLI as a user would
    from_folder = reference(seed=11)
    import_pretrained(store, "minimax-h3", {"mm-diffusers": from_folder})

    # 2. the seed's fused layout (config in the vvae.config_json tensor), other weights, and
    # a head that paints content a video codec can hold (see smooth_head)
    fused = reference(seed=12)
    smooth_head(fused, torch.Generator().manual_seed(13))
    config = config_from_diffusers(dict(fused.config))
    state = {k: v for k, v in fused.state_dict().items() if k.startswith(KEEP)}
    (tmp / "orig").mkdir()
    original_file(config, state, tmp / "orig" / "vae.safetensors", config_in_tensor=True)
    config, state = mm.convert(tmp / "orig" / "vae.safetensors")
    write_model(store, "mm-fused", "minimax-h3", config, state, source="test:vvae")

    # 3. MiniMax-H3-Image, baked like `python -m app bake --synthetic` does
    bake(store, "minimax-h3", "mm-image", mm.SYNTHETIC["minimax-h3-image-tiny"])

    oracles = {
        "mm-diffusers": from_folder,
        "mm-fused": fused,
        "mm-image": image_oracle(store),
    }
    with live_server(store, dtype="float32", device="cpu") as url:
        yield url, oracles


@torch.no_grad()
def smooth_head(vae: AutoencoderKLMiniMaxH3, generator: torch.Generator) -> None:
    """Make ``proj_out`` paint each token's ``pt x p x p`` pixel block with low-frequency
    patterns (random coefficients over a 2x2 cosine basis), as a trained head does.

    Random weights paint white noise, which no codec holds: H.264 crf 18 yuv420p gives
    15 dB on it (measured), so an MP4-vs-frames PSNR floor says nothing there. This head
    gives about 33 dB. The pt parity of this model is unaffected: proj_out is still a dense
    random projection of every channel.
    """
    proj = vae.decoder.proj_out
    pt, p = vae.decoder.patch_size_t, vae.decoder.patch_size
    dim = proj.weight.shape[1]
    axis = torch.arange(p) + 0.5
    basis = torch.stack(
        [
            torch.outer(torch.cos(math.pi * ky * axis / p), torch.cos(math.pi * kx * axis / p))
            for ky in range(2)
            for kx in range(2)
        ]
    )  # [4, p, p]
    coef = torch.randn(3, len(basis), dim, generator=generator) / math.sqrt(dim)
    frames = 1 + 0.1 * torch.randn(pt, generator=generator)  # pixel frames of one token
    weight = torch.einsum("cbd,byx,t->ctyxd", coef, basis, frames)
    proj.weight.copy_(0.5 * weight.reshape(3 * pt * p * p, dim))
    bias = 0.1 * torch.randn(3, generator=generator)
    proj.bias.copy_(bias.repeat_interleave(pt * p * p))


def image_oracle(store: Path) -> AutoencoderKLMiniMaxH3:
    """diffusers has no image variant: its decoder with the seed's (h, w) RoPE swapped in
    and patch_t 1, holding the baked weights; ``_decode_clip`` of one frame is the image."""
    _, ours = load_model(store, "mm-image")
    cfg = ours.config
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=cfg["latent_channels"],
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        spatial_downsample_factors=(2, 2, 2, 2),
        temporal_downsample_factors=(1, 1, 1, 1),
        norm_num_groups=4,
        decoder_num_layers=cfg["decoder_num_layers"],
        decoder_num_attention_heads=cfg["decoder_num_attention_heads"],
        decoder_attention_head_dim=cfg["decoder_attention_head_dim"],
        decoder_num_register_tokens=cfg["decoder_num_register_tokens"],
        latents_mean=tuple(cfg["latents_mean"]),
        latents_std=tuple(cfg["latents_std"]),
    ).eval()
    missing, unexpected = vae.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and not [k for k in missing if k.startswith(KEEP)]
    rope_dim = int(cfg["decoder_attention_head_dim"] * cfg["decoder_rope_dim_ratio"])
    vae.decoder.rope = SeedImageRope(rope_dim, cfg["decoder_rope_theta"])
    return vae


def denormalized(vae: AutoencoderKLMiniMaxH3, z: torch.Tensor) -> torch.Tensor:
    shape = (1, -1) + (1,) * (z.ndim - 2)
    mean = torch.tensor(vae.config.latents_mean).view(shape)
    std = torch.tensor(vae.config.latents_std).view(shape)
    return z * std + mean


def to_unit(x: torch.Tensor) -> torch.Tensor:
    """ImageNet-normalized RGB -> [0, 1] (channel dim 1)."""
    shape = (1, 3) + (1,) * (x.ndim - 2)
    return (
        x * torch.tensor(IMAGENET_STD).view(shape) + torch.tensor(IMAGENET_MEAN).view(shape)
    ).clamp(0, 1)


def to_uint8_frames(video: torch.Tensor) -> np.ndarray:
    """Decoder output ``[1,3,T,H,W]`` -> uint8 ``[T,H,W,3]``, rounded as the service does."""
    unit = to_unit(video)[0].permute(1, 2, 3, 0)
    return (unit * 255).round().clamp(0, 255).to(torch.uint8).numpy()


def reencoded(frames: np.ndarray, fps: float, tmp_path: Path) -> np.ndarray:
    """``frames`` through the service's own MP4 encoder here, read back."""
    return read_mp4(b"".join(mp4.encode_mp4(iter(frames), fps)), tmp_path, "local.mp4")[1]


def test_served_models(world):
    url, _ = world
    assert requests.get(f"{url}/readyz", timeout=5).status_code == 200
    body = requests.get(f"{url}/models", timeout=5).json()
    assert not body["errors"]
    models = {m["name"]: m for m in body["models"]}
    assert set(models) == {"mm-diffusers", "mm-fused", "mm-image"}
    for m in models.values():
        assert m["family"] == "minimax-h3" and not m["fallback"] and m["parity_cosine"] >= 0.99999
    assert models["mm-diffusers"]["config"]["variant"] == "video"
    assert models["mm-image"]["config"]["variant"] == "image"
    assert models["mm-image"]["config"]["video"] is False


@pytest.mark.parametrize("name", ["mm-diffusers", "mm-fused"])
def test_pt_is_the_decoder_output(world, name):
    """Both layouts: the raw (ImageNet-normalized) output, as sent and de-normalized."""
    url, oracles = world
    vae = oracles[name]
    z = latent(1, C, 3, 5, 6)
    got = remote_decode(
        f"{url}/decode/{name}", z, do_scaling=False, output_type="pt", return_type="pt"
    )
    with torch.no_grad():
        expected = vae.decode(z).sample
    assert got.shape == (1, 3, 9, 80, 96)
    check(f"{name} pt", got, expected)
    # remote_decode's default do_scaling=True: the model's own latents_mean/std (for the fused
    # file those came from its vvae.latents_mean/std tensors)
    got = remote_decode(f"{url}/decode/{name}", z, output_type="pt", return_type="pt")
    with torch.no_grad():
        expected = vae.decode(denormalized(vae, z)).sample
    check(f"{name} pt do_scaling", got, expected)


def test_pil_with_video_processor_gets_unit_frames(world):
    """remote_decode(processor=VideoProcessor(), output_type="pil") asks for a [T,3,H,W] [0,1]
    tensor (Accept: tensor/binary) and turns each of its T rows into a PIL frame."""
    url, oracles = world
    z = latent(1, C, 3, 4, 5, seed=2)
    with torch.no_grad():
        expected = to_unit(oracles["mm-fused"].decode(z).sample)[0].permute(1, 0, 2, 3)
    endpoint = f"{url}/decode/mm-fused"
    got = remote_decode(
        endpoint,
        z,
        do_scaling=False,
        processor=VideoProcessor(),
        output_type="pil",
        return_type="pt",
    )
    assert got.shape == expected.shape == (9, 3, 64, 80) and got.dtype == torch.float32
    assert 0 <= got.min() and got.max() <= 1
    err = (got - expected).abs().max().item()
    print(f"pil+VideoProcessor unit frames: max_abs={err:.2e}")
    assert err <= 1e-5
    frames = remote_decode(
        endpoint, z, do_scaling=False, processor=VideoProcessor(), output_type="pil"
    )
    assert len(frames) == 9 and all(f.size == (80, 64) for f in frames)
    diff = np.asarray(frames[4]).astype(int) - (expected[4].permute(1, 2, 0) * 255).round().numpy()
    assert np.abs(diff).max() <= 1


def test_mp4_from_remote_decode(world, tmp_path):
    """output_type=mp4 (remote_decode sends Accept: text/plain): every frame, at 24 fps, and
    exactly the H.264 of diffusers' decoded frames. This model's random head paints white
    noise (15 dB after H.264 whatever the pipeline), so the PSNR floor against the frames
    themselves is asserted on the smooth-headed model in the multi-tile test below."""
    url, oracles = world
    z = latent(1, C, 3, 4, 6, seed=3)
    data = remote_decode(
        f"{url}/decode/mm-diffusers", z, do_scaling=False, output_type="mp4", return_type="mp4"
    )
    assert isinstance(data, bytes)
    meta, got = read_mp4(data, tmp_path)
    with torch.no_grad():
        expected = to_uint8_frames(oracles["mm-diffusers"].decode(z).sample)
    assert got.shape == expected.shape == (9, 64, 96, 3)
    assert meta["size"] == (96, 64) and meta["fps"] == 24
    same = psnr(got, reencoded(expected, 24, tmp_path))
    print(
        f"mp4: vs the same frames encoded here {same:.1f} dB, vs the frames {psnr(got, expected):.1f} dB"
    )
    assert same >= SAME_PSNR


def test_multi_tile_multi_chunk_video(world, tmp_path):
    """288x320 px (2x2 spatial tiles) and 8 latent frames (2 temporal clips): pt matches
    diffusers, and the MP4 holds all 26 frames at the asked fps."""
    url, oracles = world
    vae = oracles["mm-fused"]
    z = latent(1, C, 8, 18, 20, seed=4)
    assert len(split_tiles(288, 16)[0]) == 2 and len(split_tiles(320, 16)[0]) == 2
    assert len(clip_plan(8, 4).clips) == 2
    with torch.no_grad():
        expected = vae.decode(z).sample
    r = post(url, "mm-fused", z, output_type="pt")
    got = tensor_of(r)
    assert list(got.shape) == [1, 3, 26, 288, 320]
    check("2x2 tiles, 2 clips pt", got, expected)
    phases = {"embed", "blocks", "head", "unpatchify", "tile_blend", "chunk_blend"}
    assert phases <= timed_phases(r)

    r = post(url, "mm-fused", z, output_type="mp4", fps=12)
    assert r.headers["content-type"] == "video/mp4"
    meta, frames = read_mp4(r.content, tmp_path)
    assert frames.shape == (26, 288, 320, 3)
    assert meta["size"] == (320, 288) and meta["fps"] == 12
    decoded = to_uint8_frames(got)
    quality, same = psnr(frames, decoded), psnr(frames, reencoded(decoded, 12, tmp_path))
    print(
        f"2x2 tiles, 2 clips mp4: vs pt frames {quality:.1f} dB, vs them encoded here {same:.1f} dB"
    )
    assert quality >= MP4_MIN_PSNR and same >= SAME_PSNR


def test_single_frame_as_png(world):
    """One latent frame decodes to one pixel frame; asked for as an image it is one PNG."""
    url, oracles = world
    vae = oracles["mm-diffusers"]
    z = latent(1, C, 1, 6, 7, seed=5)
    image = remote_decode(
        f"{url}/decode/mm-diffusers", z, do_scaling=False, output_type="pil", image_format="png"
    )
    assert isinstance(image, Image.Image) and image.format == "png" and image.size == (112, 96)
    with torch.no_grad():  # diffusers' decode cannot take 1 frame: its clip, pre-pad cut
        frame = vae._decode_clip(z)[:, :, vae.frame_pre_padding :]
    expected = to_uint8_frames(frame)
    assert expected.shape[0] == 1
    assert np.abs(np.asarray(image).astype(int) - expected[0].astype(int)).max() <= 1


def test_image_variant(world):
    """MiniMax-H3-Image: [B,C,H,W] -> [B,3,16H,16W], 2x2 tiles, as pt and as a PNG."""
    url, oracles = world
    vae = oracles["mm-image"]
    z = latent(1, 24, 18, 20, seed=6)
    endpoint = f"{url}/decode/mm-image"
    got = remote_decode(endpoint, z, do_scaling=False, output_type="pt", return_type="pt")
    with torch.no_grad():
        expected = vae._decode_clip(z.unsqueeze(2)).squeeze(2)
    assert got.shape == (1, 3, 288, 320)
    check("image variant pt", got, expected)
    image = remote_decode(endpoint, z, output_type="pil", image_format="png")  # do_scaling
    with torch.no_grad():
        scaled = vae._decode_clip(denormalized(vae, z).unsqueeze(2))
    expected = to_uint8_frames(scaled)[0]
    assert image.size == (320, 288)
    assert np.abs(np.asarray(image).astype(int) - expected.astype(int)).max() <= 1
    r = requests.post(
        endpoint,
        params={"output_type": "mp4", "shape": json.dumps(list(z.shape))},
        data=z.numpy().tobytes(),
        headers={"Content-Type": "tensor/binary"},
        timeout=30,
    )
    assert r.status_code == 422 and "video" in r.json()["error"]
