"""The MiniMax-H3 encoder against diffusers' AutoencoderKLMiniMaxH3.encode (random weights,
float32): its clips (padding, token drop), its default tiles, one frame, untiled."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3

from app.families.minimax_h3 import encoder as minimax_h3
from tests import helpers
from tests.helpers import check_moments, reference_dist, rgb_video

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
    ref = helpers.seeded(
        AutoencoderKLMiniMaxH3,
        **DECODER,
        **kwargs,
        latents_mean=(0.0,) * n,
        latents_std=(1.0,) * n,
    )
    return helpers.encoder_pair(minimax_h3, ref, helpers.listed(kwargs))


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
    helpers.check_encode(f"{name} {shape}", *make_pair(name), shape)


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
    x = rgb_video(5, *hw)
    got = ours.moments(x, tile_sample_size=16, tile_sample_overlap=4)
    check_moments(f"small tiles {hw}", got, reference_dist(ref, x))
    assert not torch.allclose(ours.moments(x, tiled=False), got)


def test_untiled_matches_diffusers():
    ref, ours = make_pair("small")
    ref.disable_tiling()
    x = rgb_video(10, 24, 24)
    ours_m = ours.moments(x, tiled=False, tile_sample_size=16, tile_sample_overlap=4)
    check_moments("small untiled", ours_m, reference_dist(ref, x))


def test_normalize_and_convert(tmp_path):
    ref, ours = make_pair("small")
    enc = minimax_h3.Encoder({**ours.config, "latents_mean": [1.0] * 4, "latents_std": [2.0] * 4})
    z = torch.randn(1, 4, 2, 2, 2)
    torch.testing.assert_close(enc.normalize(z), (z - 1.0) / 2.0)
    helpers.check_folder_import(minimax_h3, ref, ours, tmp_path / "vae", rgb_video(5, 16, 16))


def test_stages_hold_every_parameter_in_order():
    helpers.check_encoder_stages(make_pair("small")[1], has_mid=False)


@pytest.mark.parametrize("name", list(minimax_h3.SYNTHETIC))
def test_synthetic_weights(name):
    helpers.check_synthetic_encoder(minimax_h3, name)


@pytest.mark.parametrize("config,shape", [({}, (1, 3, 17, 256, 256)), ({}, (1, 3, 17, 512, 384))])
def test_working_bytes_cover_the_measured_peak(config, shape):
    helpers.check_working_bytes(minimax_h3, config, shape)


def test_bad_input_is_a_value_error():
    helpers.check_bad_input_refused(minimax_h3)
