"""The LTX-Video decoder against diffusers' AutoencoderKLLTXVideo.decode (random weights)."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from diffusers import AutoencoderKLLTXVideo
from diffusers.loaders.single_file_utils import convert_ltx_vae_checkpoint_to_diffusers
from diffusers.pipelines.ltx.pipeline_ltx import LTXPipeline
from safetensors.torch import save_file

from app.families.ltx import decoder as ltx
from app.families.ltx.decoder.model import decoder_spec
from app.families.ops import WEIGHT_HEAVY, conv3d
from tests import helpers
from tests.helpers import decoder_state, latent, report, seeded, with_stats

# a tiny encoder: diffusers always builds one, the tests never use it
ENCODER = dict(block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1))
V091_BLOCKS = dict(
    decoder_block_out_channels=(8, 16, 32),
    decoder_layers_per_block=(1, 1, 1, 1),
    decoder_spatio_temporal_scaling=(True, True, True),
    upsample_residual=(True, True, True),
    upsample_factor=(2, 2, 2),
)
VARIANTS = {
    # 0.9.0: channel-changing conv_in resnets (norm3 + 1x1 shortcut), plain upsamplers
    "v090": dict(
        decoder_block_out_channels=(4, 8, 16, 16),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        decoder_spatio_temporal_scaling=(True, True, True, False),
    ),
    # 0.9.1: timestep conditioning, noise injection, residual 2x upsamplers
    "v091": dict(
        **V091_BLOCKS, timestep_conditioning=True, decoder_inject_noise=(True, True, True, False)
    ),
    # 0.9.5+: the same blocks without noise, causal and not
    "v095": dict(**V091_BLOCKS, timestep_conditioning=True),
    "v095-causal": dict(**V091_BLOCKS, timestep_conditioning=True, decoder_causal=True),
    # residual upsamplers at factor 1, causal, patch 2, two layers: what else the config allows
    "residual-p2": dict(
        decoder_block_out_channels=(8, 8, 8),
        decoder_layers_per_block=(2, 1, 1, 2),
        decoder_spatio_temporal_scaling=(True, False, True),
        upsample_residual=(True, False, True),
        decoder_causal=True,
        patch_size=2,
    ),
}
LATENT_CHANNELS = 8
TIMESTEP = 0.05
SEED = 7
# diffusers' decode at the tests' timestep, its noise seeded like ours
reference_decode = partial(helpers.ltx_decode, timestep=TIMESTEP, seed=SEED)


def make_pair(variant: str) -> tuple[AutoencoderKLLTXVideo, ltx.Decoder]:
    """A diffusers VAE with random weights and our decoder loaded from its state dict."""
    kwargs = VARIANTS[variant]
    ref = seeded(AutoencoderKLLTXVideo, latent_channels=LATENT_CHANNELS, **ENCODER, **kwargs)
    helpers.noise_scales_count(ref)
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
    ours = ltx.Decoder({"latent_channels": LATENT_CHANNELS, **config}).eval()
    ours.load_state_dict(decoder_state(ref))
    return ref, ours


def clip(frames: int, h: int = 2, w: int = 3, batch: int = 1) -> torch.Tensor:
    return latent(batch, LATENT_CHANNELS, frames, h, w, seed=frames * 100 + h * 10 + w)


@pytest.mark.parametrize("frames", [1, 2, 3])
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_matches_diffusers(variant, frames):
    ref, ours = make_pair(variant)
    z = clip(frames, batch=2 if frames == 2 else 1)
    expected = reference_decode(ref, z)
    # 3 latent frames run as 3 temporal chunks with state carried across them
    got = ours.decode(z, timestep=TIMESTEP, seed=SEED, chunk_frames=1 if frames == 3 else 2)
    assert got.shape == expected.shape
    assert got.shape[2] == ours.frames_out(frames)
    assert report(f"{variant} T={frames}", got, expected) >= 0.99999


@pytest.mark.parametrize("variant", ["v090", "v091", "v095-causal"])
def test_temporal_chunks_are_exact(variant):
    """One latent frame at a time, carried state across chunks == one pass."""
    _, ours = make_pair(variant)
    helpers.check_temporal_chunks(variant, ours, clip(4, 2, 2), timestep=TIMESTEP, seed=SEED)


def test_noise_seed():
    _, ours = make_pair("v091")
    z = clip(2)
    a = ours.decode(z, timestep=TIMESTEP, seed=1)
    b = ours.decode(z, timestep=TIMESTEP, seed=1, chunk_frames=1)
    c = ours.decode(z, timestep=TIMESTEP, seed=2)
    assert torch.equal(a, ours.decode(z, timestep=TIMESTEP, seed=1))
    assert (a - b).abs().max() < 1e-5
    assert (a - c).abs().max() > 1e-3


def test_no_noise_draws_nothing():
    _, ours = make_pair("v095")
    state = torch.get_rng_state()
    a = ours.decode(clip(2), seed=1)
    assert torch.equal(state, torch.get_rng_state())
    assert torch.equal(a, ours.decode(clip(2), seed=2))


def test_timestep_default_and_effect():
    ref, ours = make_pair("v095")
    z = clip(1)
    assert torch.equal(ours.decode(z), ours.decode(z, timestep=0.0))  # LTXPipeline's default
    assert (ours.decode(z, timestep=0.5) - ours.decode(z)).abs().max() > 1e-3
    with torch.no_grad():
        expected = ref.decode(z, torch.tensor([0.5])).sample
    assert report("v095 timestep=0.5", ours.decode(z, timestep=0.5), expected) >= 0.99999


def test_tiled_is_blended_within_bound():
    """Spatial tiles vs the untiled decode, on trained-like weights; diffusers' own tiling
    at the same tile geometry is the yardstick."""
    ref, ours = make_pair("v091")
    ltx.init_synthetic(ours, torch.Generator().manual_seed(0))
    ref.decoder.load_state_dict(ours.state_dict())
    z = clip(2, 4, 6)
    whole = ours.decode(z, timestep=TIMESTEP, seed=SEED)
    tiled = ours.decode(z, timestep=TIMESTEP, seed=SEED, tiled=True, tile_size=4, tile_overlap=2)
    ref_whole = reference_decode(ref, z)
    ref.enable_tiling(128, 128, None, 64, 64)  # the same geometry: 4-cell tiles, 2-cell stride
    ref_tiled = reference_decode(ref, z)
    assert report("untiled vs diffusers", whole, ref_whole) >= 0.99999
    ours_cos = report("ours tiled vs untiled", tiled, whole)
    ref_cos = report("diffusers tiled vs untiled", ref_tiled, ref_whole)
    # tiny 128-px tiles with 64-px overlaps are the harsh case (docs/families/ltx.md has
    # larger geometries); the bound: no worse than diffusers' tiling, and cos >= 0.95
    assert ours_cos >= max(ref_cos, 0.95)


def test_geometry_and_timer():
    _, ours = make_pair("v091")
    assert (ours.spatial_scale, ours.temporal_scale, ours.frames_out(3)) == (32, 8, 17)
    probe = ours.probe_latent(torch.Generator().manual_seed(0))
    assert probe.shape == (1, LATENT_CHANNELS, 2, 4, 4)
    phases = helpers.stage_phases(ours, probe, seed=0)
    assert phases == ["condition", "conv_in", "mid", "up_0", "up_1", "up_2", "conv_out"]
    assert "blend" in helpers.stage_phases(
        ours, probe, seed=0, tiled=True, tile_size=2, tile_overlap=1
    )
    untiled = ours.decode(probe, seed=0)  # the old option name "tile" is no longer read
    assert torch.equal(ours.decode(probe, seed=0, tile=True, tile_size=2), untiled)
    image = ours.decode(probe[:, :, 0], seed=0)  # an image latent: one frame, 4-D out
    assert torch.equal(image, ours.decode(probe[:, :, :1], seed=0)[:, :, 0])
    with pytest.raises(ValueError, match="conv_in"):
        ltx.Decoder({"decoder_block_out_channels": [8, 16], "decoder_layers_per_block": [1] * 3,
                     "decoder_spatio_temporal_scaling": [True, True],
                     "decoder_inject_noise": [True] * 3})  # fmt: skip


def test_synthetic_is_deterministic():
    config = ltx.SYNTHETIC["ltx-tiny"]
    helpers.synthetic_twins(ltx, config, seed=3)
    json.dumps(config)  # a store manifest holds it


# --- conversion ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["v090", "v091"])
def test_convert_diffusers_folder(variant, tmp_path):
    ref, _ = make_pair(variant)
    _, ours, config = helpers.import_pair(with_stats(ref), ltx, tmp_path / "pipe")
    assert ltx.convert(tmp_path / "pipe" / "vae")[0] == config
    z = clip(2)
    got = ours.decode(z, timestep=TIMESTEP, seed=SEED)
    assert report(f"{variant} converted", got, reference_decode(ref, z)) >= 0.99999
    expected = LTXPipeline._denormalize_latents(
        z, ref.latents_mean, ref.latents_std, ref.config.scaling_factor
    )
    assert torch.allclose(ours.denormalize(z), expected)
    assert config["fps"] == 25


def lightricks_checkpoint(ref: AutoencoderKLLTXVideo) -> tuple[dict, dict]:
    """Write diffusers' weights in Lightricks' original single-file layout (and its config):
    one flat ``up_blocks.N`` list of res_x / res_x_y / compress_all blocks."""
    blocks = [("mid_block", ["res_x", {}])]
    residual = list(reversed(ref.config.upsample_residual))
    factor = list(reversed(ref.config.upsample_factor))
    for i, block in enumerate(ref.decoder.up_blocks):
        if block.conv_in is not None:
            blocks.append((f"up_blocks.{i}.conv_in", ["res_x_y", {}]))
        if block.upsamplers is not None:
            params = {"residual": residual[i], "multiplier": factor[i]}
            blocks.append((f"up_blocks.{i}.upsamplers.0", ["compress_all", params]))
        blocks.append((f"up_blocks.{i}", ["res_x", {}]))
    tensors = {"vae.decoder." + _original_name(k, blocks): v for k, v in decoder_state(ref).items()}
    tensors["vae.per_channel_statistics.mean-of-means"] = ref.latents_mean
    tensors["vae.per_channel_statistics.std-of-means"] = ref.latents_std
    tensors["vae.per_channel_statistics.channel"] = torch.arange(LATENT_CHANNELS)
    tensors["vae.per_channel_statistics.mean-of-stds"] = torch.ones(LATENT_CHANNELS)
    tensors["vae.encoder.conv_out.conv.weight"] = torch.zeros(1, 8, 1, 1, 1)  # detection only
    vae = {
        "decoder_blocks": [kind for _, kind in reversed(blocks)],  # listed encoder-side first
        "patch_size": ref.config.patch_size,
        "causal_decoder": ref.config.decoder_causal,
    }
    return tensors, {"vae": vae}


def _original_name(key: str, blocks: list[tuple[str, list]]) -> str:
    """Lightricks' name, 0.9.0's channel-changing resnets (norm3, 1x1 shortcut) included."""
    key = helpers.lightricks_decoder_name(key, blocks)
    return key.replace("conv_shortcut.conv.", "conv_shortcut.").replace("norm3.", "norm3.norm.")


@pytest.mark.parametrize("variant", ["v090", "v091", "residual-p2"])
def test_convert_lightricks_single_file(variant, tmp_path):
    ref = with_stats(make_pair(variant)[0])
    tensors, meta = lightricks_checkpoint(ref)
    if variant != "residual-p2":  # diffusers' own converter knows only the released layouts
        theirs = convert_ltx_vae_checkpoint_to_diffusers(dict(tensors))
        assert {k: v for k, v in theirs.items() if k.startswith("decoder.")}.keys() == {
            "decoder." + k for k in decoder_state(ref)
        }
    path = tmp_path / "ltx-video.safetensors"
    save_file(tensors, str(path), metadata={"config": json.dumps(meta)})
    config, state = ltx.convert(path)
    folder_config, folder_state = ltx.convert(helpers.saved(ref, tmp_path / "vae"))
    assert state.keys() == folder_state.keys()
    assert all(torch.equal(state[k], folder_state[k]) for k in state)
    assert decoder_spec(config) == decoder_spec(folder_config)
    assert torch.allclose(torch.tensor(config["latents_mean"]), ref.latents_mean)
    if variant != "residual-p2":  # without embedded config: "residual iff factor 2" holds
        save_file(tensors, str(path))
        assert decoder_spec(ltx.convert(path)[0]) == decoder_spec(folder_config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels,size", [(64, 2), (8, 16)])
def test_conv3d_picks_the_kernel_by_shape_and_computes_the_conv(channels, size, dtype):
    """A weight far larger than its input goes to im2col + GEMM, the rest to oneDNN (float32;
    bf16: PyTorch's dispatch, which depends on the CPU); both compute PyTorch's conv."""
    conv = torch.nn.Conv3d(channels, channels, 3, padding=(0, 1, 1))
    x = torch.randn(1, channels, 3, size, size)
    heavy = conv.weight.numel() > WEIGHT_HEAVY * x.numel()
    assert heavy == (size == 2)
    with torch.no_grad(), torch.profiler.profile() as prof:
        got = conv3d(x.to(dtype), conv.to(dtype))
    kernels = {e.name for e in prof.events()}
    assert ("aten::slow_conv3d_forward" in kernels) == heavy or (
        dtype != torch.float32 and not heavy
    )
    if dtype == torch.float32:
        assert ("aten::mkldnn_convolution" in kernels) == (not heavy)
    with torch.no_grad():
        expected = conv.float()(x)
    assert helpers.cosine(got.float(), expected) >= (0.99999 if dtype == torch.float32 else 0.9999)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
