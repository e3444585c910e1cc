"""The HunyuanVideo encoder against diffusers' AutoencoderKLHunyuanVideo.encode (random
weights, float32): one pass, the reference's temporal windows (its default past 16 frames),
spatial tiles, both together; 8x and 4x spatial configs."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import AutoencoderKLHunyuanVideo

from app.families.hunyuan_video import encoder as hunyuan_video
from tests import helpers
from tests.helpers import check_moments, reference_dist, rgb_video

VARIANTS = {
    "t4": dict(
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        norm_num_groups=4,
        latent_channels=4,
    ),
    # 4x space (time and space downsampled together in block 1), no mid attention, two
    # resnets a block
    "s4": dict(
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=2,
        norm_num_groups=2,
        latent_channels=4,
        spatial_compression_ratio=4,
        mid_block_add_attention=False,
    ),
}


def make_pair(name: str):
    kwargs = VARIANTS[name]
    ref = helpers.seeded(AutoencoderKLHunyuanVideo, **kwargs)
    return helpers.encoder_pair(hunyuan_video, ref, helpers.listed(kwargs))


@pytest.mark.parametrize(
    "name,shape", [("t4", (9, 16, 24)), ("t4", (1, 16, 16)), ("s4", (9, 16, 8)), ("t4", (21, 8, 8))]
)
def test_encode_matches_diffusers(name, shape):
    """21 frames: the reference's default 17-frame windows every 12 frames."""
    helpers.check_encode(f"{name} {shape}", *make_pair(name), shape)


@pytest.mark.parametrize("hw", [(8, 8), (40, 48)])
def test_windows_and_tiles_match_diffusers(hw):
    """8-frame windows every 4 frames; at 40x48 each window in 32-pixel tiles every 16."""
    ref, ours = make_pair("t4")
    opts = dict(
        tile_sample_frames=8, tile_sample_frame_stride=4, tile_sample_size=32, tile_sample_stride=16
    )
    helpers.tile_reference(
        ref, 32, 16, tile_sample_min_num_frames=8, tile_sample_stride_num_frames=4
    )
    x = rgb_video(13, *hw)
    got = ours.moments(x, tiled=True, **opts)
    check_moments(f"t4 windows+tiles {hw}", got, reference_dist(ref, x))
    plain = ours.moments(x, framewise=False)
    assert plain.shape == got.shape and not torch.allclose(plain, got)


def test_tiles_only_match_diffusers():
    ref, ours = make_pair("s4")
    helpers.check_tiled_encode("s4", ref, ours, rgb_video(9, 24, 32), 16, 8)


def test_temporal_ratio_8_refused():
    """diffusers' encoder has an 8x layout, but its VAE cannot be built with one."""
    with pytest.raises(ValueError, match="temporal_compression_ratio"):
        hunyuan_video.Encoder({"temporal_compression_ratio": 8})


def test_normalize_and_convert(tmp_path):
    ref, ours = make_pair("t4")
    z = torch.randn(1, 4, 2, 2, 2)
    torch.testing.assert_close(ours.normalize(z), z * 0.476986)
    helpers.check_folder_import(hunyuan_video, ref, ours, tmp_path / "vae", rgb_video(5, 16, 16))


def test_stages_hold_every_parameter_in_order():
    helpers.check_encoder_stages(make_pair("t4")[1])


@pytest.mark.parametrize("name", list(hunyuan_video.SYNTHETIC))
def test_synthetic_weights(name):
    helpers.check_synthetic_encoder(hunyuan_video, name)


# --- original checkpoints ------------------------------------------------------------------------
@pytest.mark.parametrize("as_folder", [True, False], ids=["folder", "file"])
def test_convert_original_checkpoint(tmp_path, as_folder):
    """``pytorch_model.pt`` as hyvideo's load_vae reads it (``state_dict``, ``vae.`` keys,
    a training leftover) with its config.json."""
    ref, _ = make_pair("s4")
    torch.save(helpers.hunyuan_original_checkpoint(ref), tmp_path / "pytorch_model.pt")
    config = {**helpers.hunyuan_original_config(ref), "spatial_compression_ratio": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    source = tmp_path if as_folder else tmp_path / "pytorch_model.pt"
    enc = helpers.encoder_from(hunyuan_video, *hunyuan_video.convert(source))
    x = rgb_video(5, 16, 16)
    check_moments("s4 original", enc.moments(x), reference_dist(ref, x))


def test_convert_single_file_without_config(tmp_path):
    """A lone repack: the config from the shapes and the published values (32 groups)."""
    from safetensors.torch import save_file

    ref = helpers.seeded(
        AutoencoderKLHunyuanVideo,
        block_out_channels=(32, 32, 64, 64),
        layers_per_block=1,
        latent_channels=16,
    )
    path = tmp_path / "hunyuan_video_vae.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    config, state = hunyuan_video.convert(path)
    assert config["block_out_channels"] == [32, 32, 64, 64] and config["norm_num_groups"] == 32
    enc = helpers.encoder_from(hunyuan_video, config, state)
    x = rgb_video(5, 16, 16)
    check_moments("repack", enc.moments(x), reference_dist(ref, x))


def test_decoder_only_checkpoint_refused(tmp_path):
    from safetensors.torch import save_file

    ref, _ = make_pair("t4")
    decoder = {k: v.contiguous() for k, v in ref.state_dict().items() if k.startswith("decoder.")}
    save_file(decoder, str(tmp_path / "vae.safetensors"))
    with pytest.raises(ValueError, match="decoder-only"):
        hunyuan_video.convert(tmp_path / "vae.safetensors")


@pytest.mark.parametrize("config,shape", [({}, (1, 3, 17, 256, 256)), ({}, (1, 3, 9, 128, 256))])
def test_working_bytes_cover_the_measured_peak(config, shape):
    helpers.check_working_bytes(hunyuan_video, config, shape)


def test_bad_input_is_a_value_error():
    helpers.check_bad_input_refused(hunyuan_video)
