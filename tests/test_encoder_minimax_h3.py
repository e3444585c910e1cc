"""The MiniMax-H3 encoder against diffusers' AutoencoderKLMiniMaxH3.encode (random weights,
float32): its clips (padding, token drop), its default tiles, one frame, untiled."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3

from app.encoders import minimax_h3
from tests.helpers import report, saved, seeded

pytestmark = pytest.mark.usefixtures("one_thread")

# a tiny ViT decoder: diffusers always builds one, these tests never use it
DECODER = dict(
    decoder_num_layers=1,
    decoder_num_attention_heads=1,
    decoder_attention_head_dim=8,
    decoder_num_register_tokens=1,
    decoder_ffn_mult=1,
)
VARIANTS = {
    # the released geometry at tiny widths: 16x space, 4x time, 17-frame clips, 3 dropped
    "released": dict(
        block_out_channels=(8, 8, 16, 16, 16, 16),
        layers_per_block=1,
        norm_num_groups=4,
        latent_channels=4,
    ),
    # 4x space, 2x time, 5-frame clips with 1 dropped, two resnets, replicate padding
    "small": dict(
        block_out_channels=(8, 16, 16),
        layers_per_block=2,
        norm_num_groups=2,
        latent_channels=4,
        spatial_downsample_factors=(2, 2, 1),
        temporal_downsample_factors=(1, 2, 1),
        clip_length=5,
        token_drop=1,
        spatial_padding_mode="replicate",
    ),
}


def make_pair(name: str):
    kwargs = VARIANTS[name]
    n = kwargs["latent_channels"]
    ref = seeded(
        AutoencoderKLMiniMaxH3,
        **DECODER,
        **kwargs,
        latents_mean=(0.0,) * n,
        latents_std=(1.0,) * n,
    )
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
    ours = minimax_h3.Encoder(config).eval()
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
    "name,shape",
    [
        ("released", (17, 32, 48)),
        ("released", (1, 32, 32)),
        ("small", (12, 16, 24)),  # padded to 15 frames: 3 clips of 5, 1 latent dropped
        ("small", (1, 12, 20)),
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


@pytest.mark.parametrize("hw", [(40, 72), (24, 24)])
def test_tiles_match_diffusers(hw):
    """16-pixel tiles, overlaps of at least 4 grown in whole latent cells to cover the frame."""
    ref, ours = make_pair("small")
    ref.enable_tiling(
        tile_sample_min_height=16,
        tile_sample_min_width=16,
        tile_sample_min_overlap_height=4,
        tile_sample_min_overlap_width=4,
    )
    x = clip(5, *hw)
    with torch.no_grad():
        expected = ref.encode(x).latent_dist
    got = ours.moments(x, tile_sample_size=16, tile_sample_overlap=4)
    check_moments(f"small tiles {hw}", got, expected)
    assert not torch.allclose(ours.moments(x, tiled=False), got)


def test_untiled_matches_diffusers():
    ref, ours = make_pair("small")
    ref.disable_tiling()
    x = clip(10, 24, 24)
    ours_m = ours.moments(x, tiled=False, tile_sample_size=16, tile_sample_overlap=4)
    with torch.no_grad():
        expected = ref.encode(x).latent_dist
    check_moments("small untiled", ours_m, expected)


def test_normalize_and_convert(tmp_path):
    ref, ours = make_pair("small")
    enc = minimax_h3.Encoder({**ours.config, "latents_mean": [1.0] * 4, "latents_std": [2.0] * 4})
    z = torch.randn(1, 4, 2, 2, 2)
    torch.testing.assert_close(enc.normalize(z), (z - 1.0) / 2.0)
    config, state = minimax_h3.convert(saved(ref, tmp_path / "vae"))
    loaded = minimax_h3.Encoder(config).eval()
    loaded.load_state_dict(state)
    x = clip(5, 16, 16)
    torch.testing.assert_close(loaded.moments(x), ours.moments(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(minimax_h3.SYNTHETIC))
def test_synthetic_weights(name):
    enc = minimax_h3.Encoder(minimax_h3.SYNTHETIC[name]).eval()
    minimax_h3.init_synthetic(enc, torch.Generator().manual_seed(0))
    x = enc.probe_input(torch.Generator().manual_seed(1))
    m = enc.moments(x)
    assert m.shape[1] == 2 * enc.latent_channels
    assert m.shape[2] == enc.latent_frames(x.shape[2])
    assert torch.isfinite(m).all() and 0.05 < m.std() < 20


@pytest.mark.parametrize("config,shape", [({}, (1, 3, 17, 256, 256)), ({}, (1, 3, 17, 512, 384))])
def test_working_bytes_cover_the_measured_peak(config, shape):
    """The memory plan's estimate against the peak live tensor bytes of an encode of the
    published architecture, measured on the meta device: enough, and not wildly more."""
    from bench.meta_memory import live_peak

    with torch.device("meta"):
        enc = minimax_h3.Encoder(config).eval()
    x = torch.empty(shape, device="meta")
    peak = live_peak(lambda: enc.moments(x))
    estimate = enc.working_bytes(shape, 4)
    print(f"{shape}: peak {peak / 2**20:.0f} MiB, estimate {estimate / 2**20:.0f} MiB")
    assert peak <= estimate <= 1.5 * peak


def test_bad_input_is_a_value_error():
    enc = minimax_h3.Encoder(minimax_h3.SYNTHETIC[next(iter(minimax_h3.SYNTHETIC))]).eval()
    s = enc.spatial_scale
    with pytest.raises(ValueError, match="multiples of"):
        enc.moments(torch.zeros(1, 3, 1, s, s + s // 2))
    with pytest.raises(ValueError, match="expected"):
        enc.moments(torch.zeros(1, 4, 1, s, s))
