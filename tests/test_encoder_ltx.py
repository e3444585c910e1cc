"""The LTX encoders against diffusers' AutoencoderKLLTXVideo / AutoencoderKLLTX2Video.encode
(random weights, float32): moments and mean, plain and tiled, several configs and shapes."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLLTX2Video, AutoencoderKLLTXVideo

from app.encoders import ltx
from tests.helpers import report, saved, seeded

pytestmark = pytest.mark.usefixtures("one_thread")

LATENT = 8
# a tiny decoder: diffusers always builds one, these tests never use it
DECODER = dict(
    decoder_block_out_channels=(8, 8, 8, 8),
    decoder_layers_per_block=(1, 1, 1, 1, 1),
)
LTX2_DECODER = dict(decoder_block_out_channels=(8, 8, 8), decoder_layers_per_block=(1, 1, 1, 1))
VARIANTS = {
    # 0.9.0/0.9.1: stride-2 convs, channel-changing resnets closing each block
    "v090": dict(
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False),
    ),
    # 0.9.5+: space-to-depth downsamplers of each kind and one conv, non-causal, patch 2
    "v095": dict(
        block_out_channels=(8, 16, 32, 32, 32),
        down_block_types=("LTXVideo095DownBlock3D",) * 4,
        spatio_temporal_scaling=(True, True, True, True),
        layers_per_block=(1, 2, 1, 1, 1),
        downsample_type=("spatial", "temporal", "spatiotemporal", "conv"),
        patch_size=2,
        encoder_causal=False,
    ),
}
LTX2_VARIANTS = {
    "ltx2": dict(
        block_out_channels=(16, 16, 32, 32),
        layers_per_block=(1, 1, 1, 1, 1),
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    ),
    "ltx2-reflect": dict(
        block_out_channels=(16, 32, 32),
        layers_per_block=(1, 1, 2, 1),
        spatio_temporal_scaling=(True, True, False),
        downsample_type=("spatiotemporal", "spatial", "spatial"),
        encoder_spatial_padding_mode="reflect",
        patch_size=2,
    ),
}


def make_pair(name: str, **extra):
    if name in LTX2_VARIANTS:
        kwargs = {**LTX2_VARIANTS[name], **extra}
        ref = seeded(AutoencoderKLLTX2Video, latent_channels=LATENT, **LTX2_DECODER, **kwargs)
        config = {"version": "ltx2"}
    else:
        kwargs = {**VARIANTS[name], **extra}
        ref = seeded(AutoencoderKLLTXVideo, latent_channels=LATENT, **DECODER, **kwargs)
        config = {}
    config.update({k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()})
    ours = ltx.Encoder({"latent_channels": LATENT, **config}).eval()
    state = {k: v for k, v in ref.state_dict().items() if k.startswith("encoder.")}
    ours.load_state_dict(state)
    return ref, ours


def clip(frames: int, h: int, w: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(frames * 1000 + h + w)
    return torch.rand((batch, 3, frames, h, w), generator=g) * 2 - 1


def check_moments(name: str, got: torch.Tensor, ref_dist) -> None:
    expected = ref_dist.parameters
    assert got.shape == expected.shape
    assert report(f"{name} moments", got, expected) >= 0.99999
    mean = got.chunk(2, dim=1)[0]
    assert report(f"{name} mean", mean, ref_dist.mean) >= 0.99999


@pytest.mark.parametrize(
    "name,shape",
    [
        ("v090", (9, 32, 64)),
        ("v090", (1, 32, 32)),
        ("v095", (17, 32, 16)),
        ("ltx2", (9, 64, 32)),
        ("ltx2-reflect", (5, 32, 48)),
    ],
)
def test_encode_matches_diffusers(name, shape):
    ref, ours = make_pair(name)
    x = clip(*shape, batch=2 if shape[0] == 1 else 1)
    with torch.no_grad():
        expected = ref.encode(x).latent_dist
    got = ours.moments(x)
    check_moments(f"{name} {shape}", got, expected)
    assert got.shape[2] == ours.latent_frames(shape[0])
    assert got.shape[-1] * ours.spatial_scale == shape[-1]


@pytest.mark.parametrize(
    "name,size,stride,hw", [("v090", 128, 64, (160, 192)), ("ltx2-reflect", 32, 16, (48, 80))]
)
def test_tiled_matches_diffusers(name, size, stride, hw):
    """diffusers' enable_tiling path: overlapping tiles, a partial last row and column."""
    ref, ours = make_pair(name)
    ref.enable_tiling(
        tile_sample_min_height=size,
        tile_sample_min_width=size,
        tile_sample_stride_height=stride,
        tile_sample_stride_width=stride,
    )
    x = clip(9, *hw)
    with torch.no_grad():
        expected = ref.encode(x).latent_dist
    got = ours.moments(x, tiled=True, tile_sample_size=size, tile_sample_stride=stride)
    check_moments(f"{name} tiled", got, expected)
    plain = ours.moments(x)
    assert not torch.allclose(plain, got)  # the tiles did change the result


@pytest.mark.parametrize("name", ["v090", "ltx2"])
def test_framewise_matches_diffusers(name):
    """diffusers' temporal windows (use_framewise_decoding): 17-frame windows every 8 frames
    over 33 frames (blended over one latent frame; the last window one frame long), measured
    in the config's ratios."""
    ref, ours = make_pair(name, temporal_compression_ratio=8, spatial_compression_ratio=32)
    ref.use_framewise_decoding = True
    ref.enable_tiling(tile_sample_min_num_frames=16, tile_sample_stride_num_frames=8)
    x = clip(33, 32, 32)
    with torch.no_grad():
        expected = ref.encode(x).latent_dist
    got = ours.moments(x, framewise=True, tile_sample_frames=16, tile_sample_frame_stride=8)
    check_moments(f"{name} framewise", got, expected)
    assert not torch.allclose(ours.moments(x), got)


def test_image_input_and_normalize():
    _, ours = make_pair("v090")
    x = clip(1, 32, 32)
    assert torch.equal(ours.moments(x[:, :, 0]), ours.moments(x)[:, :, 0])
    ours2 = ltx.Encoder(
        {**ours.config, "latents_mean": [0.5] * LATENT, "latents_std": [2.0] * LATENT}
    )
    z = torch.randn(1, LATENT, 2, 2, 2)
    torch.testing.assert_close(ours2.normalize(z), (z - 0.5) / 2.0)


def test_convert_diffusers_folder(tmp_path):
    ref, ours = make_pair("ltx2-reflect")
    config, state = ltx.convert(saved(ref, tmp_path / "vae"))
    assert config["version"] == "ltx2"
    loaded = ltx.Encoder(config).eval()
    loaded.load_state_dict(state)
    x = clip(9, 32, 32)
    torch.testing.assert_close(loaded.moments(x), ours.moments(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(ltx.SYNTHETIC))
def test_synthetic_weights(name):
    enc = ltx.Encoder(ltx.SYNTHETIC[name]).eval()
    ltx.init_synthetic(enc, torch.Generator().manual_seed(0))
    x = enc.probe_input(torch.Generator().manual_seed(1))
    m = enc.moments(x)
    assert m.shape[1] == 2 * enc.latent_channels
    assert m.shape[2] == enc.latent_frames(x.shape[2])
    assert torch.isfinite(m).all() and 0.05 < m.std() < 20


@pytest.mark.parametrize(
    "config,shape", [({}, (1, 3, 17, 256, 256)), ({"version": "ltx2"}, (1, 3, 9, 256, 384))]
)
def test_working_bytes_cover_the_measured_peak(config, shape):
    """The memory plan's estimate against the peak live tensor bytes of an encode of the
    published architecture, measured on the meta device: enough, and not wildly more."""
    from bench.meta_memory import live_peak

    with torch.device("meta"):
        enc = ltx.Encoder(config).eval()
    x = torch.empty(shape, device="meta")
    peak = live_peak(lambda: enc.moments(x))
    estimate = enc.working_bytes(shape, 4)
    print(f"{shape}: peak {peak / 2**20:.0f} MiB, estimate {estimate / 2**20:.0f} MiB")
    assert peak <= estimate <= 1.5 * peak
