"""The LTX encoders against diffusers' AutoencoderKLLTXVideo / AutoencoderKLLTX2Video.encode
(random weights, float32): moments and mean, plain and tiled, several configs and shapes."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import AutoencoderKLLTX2Video, AutoencoderKLLTXVideo

from app.families.ltx import encoder as ltx
from tests import helpers
from tests.helpers import check_moments, reference_dist, rgb_video

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
    # the published 0.9.0 block list (Lightricks: res, down, res_x_y twice, res, down, res, mid)
    "v090-published": dict(
        block_out_channels=(8, 16, 32, 32),
        layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False),
    ),
    "v095-causal": dict(
        block_out_channels=(8, 16, 32, 32, 32),
        down_block_types=("LTXVideo095DownBlock3D",) * 4,
        spatio_temporal_scaling=(True, True, True, True),
        layers_per_block=(1, 1, 1, 1, 1),
        downsample_type=("temporal", "spatial", "conv", "spatiotemporal"),
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
        ref = helpers.seeded(
            AutoencoderKLLTX2Video, latent_channels=LATENT, **LTX2_DECODER, **kwargs
        )
        config = {"version": "ltx2"}
    else:
        kwargs = {**VARIANTS[name], **extra}
        ref = helpers.seeded(AutoencoderKLLTXVideo, latent_channels=LATENT, **DECODER, **kwargs)
        config = {}
    config.update(helpers.listed(kwargs))
    return helpers.encoder_pair(
        ltx, ref, {"latent_channels": LATENT, **config}, parts=("encoder.",)
    )


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
    helpers.check_encode(f"{name} {shape}", *make_pair(name), shape)


@pytest.mark.parametrize(
    "name,size,stride,hw", [("v090", 128, 64, (160, 192)), ("ltx2-reflect", 32, 16, (48, 80))]
)
def test_tiled_matches_diffusers(name, size, stride, hw):
    """diffusers' enable_tiling path: overlapping tiles, a partial last row and column."""
    helpers.check_tiled_encode(name, *make_pair(name), rgb_video(9, *hw), size, stride)


@pytest.mark.parametrize("name", ["v090", "ltx2"])
def test_framewise_matches_diffusers(name):
    """diffusers' temporal windows (use_framewise_decoding): 17-frame windows every 8 frames
    over 33 frames (blended over one latent frame; the last window one frame long), measured
    in the config's ratios."""
    ref, ours = make_pair(name, temporal_compression_ratio=8, spatial_compression_ratio=32)
    ref.use_framewise_decoding = True
    ref.enable_tiling(tile_sample_min_num_frames=16, tile_sample_stride_num_frames=8)
    x = rgb_video(33, 32, 32)
    got = ours.moments(x, framewise=True, tile_sample_frames=16, tile_sample_frame_stride=8)
    check_moments(f"{name} framewise", got, reference_dist(ref, x))
    assert not torch.allclose(ours.moments(x), got)


@pytest.mark.parametrize("name", ["v090", "v095-causal", "ltx2", "ltx2-reflect"])
def test_causal_stream_is_exact(name):
    """Frame chunks with carried state (1 + chunk, then chunk frames) == one pass ==
    diffusers' encode; a non-causal encoder does not stream."""
    ref, ours = make_pair(name)
    scale = ours.temporal_scale
    x = rgb_video(1 + 3 * scale, 2 * ours.spatial_scale, 2 * ours.spatial_scale)
    whole = ours.moments(x)
    expected = reference_dist(ref, x)
    for chunk in (scale, 2 * scale):
        streamed = ours.moments(x, chunk_frames=chunk)
        torch.testing.assert_close(streamed, whole, rtol=0, atol=2e-6)
        check_moments(f"{name} chunk={chunk}", streamed, expected)
    with pytest.raises(ValueError, match="multiple of"):
        ours.moments(x, chunk_frames=scale + 1)
    _, noncausal = make_pair("v095")
    assert not noncausal.streams


@pytest.mark.parametrize("name", ["v090", "v095-causal", "ltx2"])
def test_default_stream_matches_diffusers(name):
    """What is served: a causal encoder streams chunks of ``DEFAULT_CHUNK_LATENTS`` latent
    frames' worth (here 33 + 32 + 8 frames), against diffusers' one pass."""
    ref, ours = make_pair(name)
    scale = ours.temporal_scale
    x = rgb_video(1 + 2 * ltx.encode.DEFAULT_CHUNK_LATENTS * scale + scale, 32, 32)
    chunks = list(ours.iter_moments(x))
    assert len(chunks) == 3
    check_moments(f"{name} default stream", torch.cat(chunks, 2), reference_dist(ref, x))


@pytest.mark.parametrize("name", list(VARIANTS) + list(LTX2_VARIANTS))
def test_frame_rule_is_diffusers(name):
    """``frames_problem`` names exactly the counts diffusers' encode cannot take (a
    RuntimeError there; LTX-2's takes 1 + 8k, v095-causal's 1 + 8k or 3 + 8k, 0.9.0's
    stride-2 convs any count); ours refuses them with it, a ValueError."""
    ref, ours = make_pair(name)
    for frames in range(1, 12):
        x = rgb_video(frames, 2 * ours.spatial_scale, 2 * ours.spatial_scale)
        try:
            reference_dist(ref, x)
        except RuntimeError:
            assert ours.frames_problem(frames).startswith("LTX encodes"), frames
            with pytest.raises(ValueError, match=f"{frames} frames is not one"):
                ours.moments(x)
        else:
            assert ours.frames_problem(frames) == "", frames


def test_image_input_and_normalize():
    _, ours = make_pair("v090")
    x = rgb_video(1, 32, 32)
    assert torch.equal(ours.moments(x[:, :, 0]), ours.moments(x)[:, :, 0])
    ours2 = ltx.Encoder(
        {**ours.config, "latents_mean": [0.5] * LATENT, "latents_std": [2.0] * LATENT}
    )
    z = torch.randn(1, LATENT, 2, 2, 2)
    torch.testing.assert_close(ours2.normalize(z), (z - 0.5) / 2.0)


def test_convert_diffusers_folder(tmp_path):
    ref, ours = make_pair("ltx2-reflect")
    x = rgb_video(9, 32, 32)
    config, _ = helpers.check_folder_import(ltx, ref, ours, tmp_path / "vae", x)
    assert config["version"] == "ltx2"


def test_stages_hold_every_parameter_in_order():
    helpers.check_encoder_stages(make_pair("v095")[1])


@pytest.mark.parametrize("name", list(ltx.SYNTHETIC))
def test_synthetic_weights(name):
    helpers.check_synthetic_encoder(ltx, name)


@pytest.mark.parametrize(
    "config,shape", [({}, (1, 3, 17, 256, 256)), ({"version": "ltx2"}, (1, 3, 9, 256, 384))]
)
def test_working_bytes_cover_the_measured_peak(config, shape):
    helpers.check_working_bytes(ltx, config, shape)


# --- Lightricks single files -----------------------------------------------------------------
def lightricks_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' encoder names -> a Lightricks single file's (``vae.encoder.down_blocks.N``:
    each block's resnet group, its downsampler, its channel-changing resnet, then the mid)."""
    blocks = sorted({int(k.split(".")[2]) for k in state if k.startswith("encoder.down_blocks.")})
    targets, n = {}, 0
    for b in blocks:
        for part in ("resnets.", "downsamplers.0.", "conv_out."):
            prefix = f"encoder.down_blocks.{b}.{part}"
            if any(k.startswith(prefix) for k in state):
                targets[prefix] = f"encoder.down_blocks.{n}." + (
                    "res_blocks." if part == "resnets." else ""
                )
                n += 1
    targets["encoder.mid_block.resnets."] = f"encoder.down_blocks.{n}.res_blocks."
    out = {}
    for key, value in state.items():
        for prefix, new in targets.items():
            if key.startswith(prefix):
                key = new + key[len(prefix) :]
                break
        key = key.replace("conv_shortcut.conv.", "conv_shortcut.").replace("norm3.", "norm3.norm.")
        out[f"vae.{key}"] = value.contiguous()
    out["vae.decoder.conv_in.conv.weight"] = torch.zeros(1)  # the decoder half: not read
    out["vae.per_channel_statistics.mean-of-means"] = torch.linspace(-1, 1, LATENT)
    out["vae.per_channel_statistics.std-of-means"] = torch.linspace(0.5, 2, LATENT)
    out["model.diffusion_model.x"] = torch.zeros(1)  # the transformer: not read
    return out


def test_lightricks_writer_is_diffusers_own():
    """The writer agrees with diffusers' single-file converters (0.9.0 and LTX-2 layouts)."""
    from diffusers.loaders.single_file_utils import (
        convert_ltx2_vae_to_diffusers,
        convert_ltx_vae_checkpoint_to_diffusers,
    )

    for name, fn in [("v090-published", convert_ltx_vae_checkpoint_to_diffusers),
                     ("ltx2", convert_ltx2_vae_to_diffusers)]:  # fmt: skip
        ref, _ = make_pair(name)
        state = {k: v for k, v in ref.state_dict().items() if k.startswith("encoder.")}
        original = {k: v for k, v in lightricks_layout(state).items() if ".encoder." in k}
        theirs = fn(original)
        assert {k: v.shape for k, v in theirs.items()} == {k: v.shape for k, v in state.items()}


@pytest.mark.parametrize("name", ["v090-published", "v095", "ltx2"])
def test_convert_lightricks_single_file(tmp_path, name):
    """The Lightricks layout, its config inferred from the shapes, matches diffusers' encode."""
    from safetensors.torch import save_file

    ref, ours = make_pair(name)
    path = tmp_path / "ltx-video.safetensors"
    causal = {"causal": False} if name == "v095" else {}
    save_file(lightricks_layout(ours.state_dict()), str(path),
              metadata={"config": json.dumps({"vae": causal})})  # fmt: skip
    config, state = ltx.convert(path)
    assert config["latents_std"][-1] == 2.0
    loaded = helpers.encoder_from(ltx, config, state)
    x = rgb_video(9, 32, 32)
    check_moments(f"{name} lightricks file", loaded.moments(x), reference_dist(ref, x))


def test_decoder_only_files_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"vae.decoder.conv_in.conv.weight": torch.zeros(1)}, str(tmp_path / "d.safetensors"))
    with pytest.raises(ValueError, match="decoder-only"):
        ltx.convert(tmp_path / "d.safetensors")
    ref, _ = make_pair("v090")
    folder = helpers.saved(ref, tmp_path / "vae")
    save_file(
        {k: v.contiguous() for k, v in ref.state_dict().items() if k.startswith("decoder.")},
        str(folder / "diffusion_pytorch_model.safetensors"),
    )
    with pytest.raises(ValueError, match="decoder-only"):
        ltx.convert(folder)


def test_bad_input_is_a_value_error():
    helpers.check_bad_input_refused(ltx)
