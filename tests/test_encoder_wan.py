"""The Wan encoders against diffusers' AutoencoderKLWan / AutoencoderKLQwenImage.encode
(random weights, float32): the reference's 1 + 4k frame chunks with its feature cache against
our streamed pass (several chunkings), plain and tiled, Wan 2.1, Wan 2.2 TI2V, Qwen-Image."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan

from app.encoders import wan
from tests.helpers import report, saved, seeded

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = {
    "wan2.1": (
        AutoencoderKLWan,
        dict(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 2, 2],
            num_res_blocks=1,
            temperal_downsample=[True, True],
            scale_factor_spatial=4,
        ),
    ),
    # two resnets a stage, 2-D downsampling first
    "wan2.1-deep": (
        AutoencoderKLWan,
        dict(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=2,
            temperal_downsample=[False, True, True],
            scale_factor_spatial=8,
        ),
    ),
    "wan2.2": (
        AutoencoderKLWan,
        dict(
            base_dim=8,
            z_dim=12,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_spatial=16,
            latents_mean=[0.0] * 12,
            latents_std=[1.0] * 12,
        ),
    ),
    "qwen-image": (
        AutoencoderKLQwenImage,
        dict(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 2, 2],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        ),
    ),
}


def make_pair(name: str):
    cls, kwargs = VARIANTS[name]
    if cls is AutoencoderKLWan and "latents_mean" not in kwargs:
        kwargs = {**kwargs, "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4}
    ref = seeded(cls, **kwargs)
    config = {k: v for k, v in kwargs.items() if k in wan.encode.DEFAULTS}
    if cls is AutoencoderKLQwenImage:
        config["spatial_compression_ratio"] = 2 ** len(kwargs["temperal_downsample"])
    elif "scale_factor_spatial" in kwargs:
        config["spatial_compression_ratio"] = kwargs["scale_factor_spatial"]
    ours = wan.Encoder(config).eval()
    state = {k: v for k, v in ref.state_dict().items() if k.startswith(("encoder.", "quant_conv."))}
    ours.load_state_dict(state)
    return ref, ours


def clip(frames: int, h: int, w: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(frames * 1000 + h + w)
    return torch.rand((batch, 3, frames, h, w), generator=g) * 2 - 1


def check_moments(name: str, got: torch.Tensor, ref_dist) -> None:
    expected = ref_dist.parameters
    assert got.shape == expected.shape
    assert report(f"{name} moments", got, expected) >= 0.99999
    assert report(f"{name} mean", got.chunk(2, dim=1)[0], ref_dist.mean) >= 0.99999


@pytest.mark.parametrize(
    "name,shape,chunk",
    [
        ("wan2.1", (9, 16, 24), 4),
        ("wan2.1", (11, 16, 16), 0),  # 1 + 4k + 2: the last two frames are dropped, as there
        ("wan2.1-deep", (5, 32, 16), 4),
        ("wan2.2", (9, 32, 32), 8),
        ("wan2.2", (1, 32, 64), 16),
        ("qwen-image", (1, 24, 32), 16),
        ("qwen-image", (9, 16, 16), 0),
    ],
)
def test_encode_matches_diffusers(name, shape, chunk):
    ref, ours = make_pair(name)
    x = clip(*shape, batch=2 if shape[0] == 1 else 1)
    with torch.no_grad():
        expected = ref.encode(x).latent_dist
    got = ours.moments(x, chunk_frames=chunk)
    check_moments(f"{name} {shape} chunk={chunk}", got, expected)
    assert got.shape[2] == ours.latent_frames(shape[0])
    assert got.shape[-1] * ours.spatial_scale == shape[-1]


@pytest.mark.parametrize("name", ["wan2.1", "wan2.2"])
def test_chunkings_agree(name):
    """Whole clip, 4-frame and 8-frame chunks: the same stream."""
    _, ours = make_pair(name)
    x = clip(17, 32, 32)
    whole = ours.moments(x, chunk_frames=0)
    for chunk in (4, 8):
        torch.testing.assert_close(ours.moments(x, chunk_frames=chunk), whole, rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="multiple of 4"):
        ours.moments(x, chunk_frames=6)


@pytest.mark.parametrize(
    "name,size,stride,hw",
    [("wan2.1", 32, 24, (40, 56)), ("wan2.2", 32, 16, (64, 96)), ("qwen-image", 32, 16, (48, 40))],
)
def test_tiled_matches_diffusers(name, size, stride, hw):
    ref, ours = make_pair(name)
    ref.enable_tiling(
        tile_sample_min_height=size,
        tile_sample_min_width=size,
        tile_sample_stride_height=stride,
        tile_sample_stride_width=stride,
    )
    x = clip(5, *hw)
    with torch.no_grad():
        expected = ref.encode(x).latent_dist
    got = ours.moments(x, tiled=True, tile_sample_size=size, tile_sample_stride=stride)
    check_moments(f"{name} tiled", got, expected)
    assert not torch.allclose(ours.moments(x), got)


def test_attention_in_down_stages_refused():
    """diffusers builds them but its encoder cannot run them (it passes the cache to them)."""
    with pytest.raises(ValueError, match="attn_scales"):
        wan.Encoder({"base_dim": 8, "attn_scales": [0.5]})


def test_image_input_and_normalize():
    _, ours = make_pair("qwen-image")
    x = clip(1, 16, 16)
    torch.testing.assert_close(ours.moments(x[:, :, 0]), ours.moments(x)[:, :, 0])
    enc = wan.Encoder({**ours.config, "latents_mean": [1.0] * 4, "latents_std": [4.0] * 4})
    z = torch.randn(1, 4, 2, 2, 2)
    torch.testing.assert_close(enc.normalize(z), (z - 1.0) / 4.0)


@pytest.mark.parametrize("name", ["wan2.2", "qwen-image"])
def test_convert_diffusers_folder(tmp_path, name):
    ref, ours = make_pair(name)
    config, state = wan.convert(saved(ref, tmp_path / "vae"))
    assert config["variant"] == name
    loaded = wan.Encoder(config).eval()
    loaded.load_state_dict(state)
    x = clip(5, 32, 32)
    torch.testing.assert_close(loaded.moments(x), ours.moments(x), rtol=0, atol=0)
    assert (
        loaded.normalize(torch.ones(1, ours.latent_channels, 1, 1, 1)).shape[1]
        == ours.latent_channels
    )


@pytest.mark.parametrize("name", list(wan.SYNTHETIC))
def test_synthetic_weights(name):
    enc = wan.Encoder(wan.SYNTHETIC[name]).eval()
    wan.init_synthetic(enc, torch.Generator().manual_seed(0))
    x = enc.probe_input(torch.Generator().manual_seed(1))
    m = enc.moments(x)
    assert m.shape[1] == 2 * enc.latent_channels
    assert m.shape[2] == enc.latent_frames(x.shape[2])
    assert torch.isfinite(m).all() and 0.05 < m.std() < 20
