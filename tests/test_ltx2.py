"""The LTX-2 decoder against diffusers' AutoencoderKLLTX2Video.decode (random weights)."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from diffusers import AutoencoderKLLTX2Video
from diffusers.loaders.single_file_utils import convert_ltx2_vae_to_diffusers
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline
from safetensors.torch import save_file

from app.families.ltx import decoder as ltx
from app.families.ltx.decoder.ltx2 import ltx2_spec
from tests import helpers
from tests.helpers import decoder_state, latent, report, seeded, with_stats

# a tiny encoder (diffusers always builds one); 3 scaling stages, so its compression ratio
# (which diffusers' tiling sizes tiles by) is the released decoder's 32
ENCODER = dict(
    block_out_channels=(8, 8, 8, 8),
    layers_per_block=(1, 1, 1, 1, 1),
    spatio_temporal_scaling=(True, True, True, False),
)
_BLOCKS = dict(decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1, 1, 1, 1))
VARIANTS = {
    # LTX-2 as released, in miniature: reflect padding, residual 2x spatiotemporal upsamplers
    "released": dict(**_BLOCKS, decoder_causal=False),
    # each upsampler kind (decode order: spatial, temporal, both), causal, timestep, noise
    "kinds-causal": dict(
        **_BLOCKS,
        upsample_type=("spatial", "temporal", "spatiotemporal"),
        upsample_residual=(True, False, False),  # encoder order: residual on the last one
        decoder_causal=True,
        timestep_conditioning=True,
        decoder_inject_noise=(True, True, False, False),
    ),
    # channel-changing conv_in resnets (LayerNorm + plain 1x1 shortcut), zeros padding, patch 2
    "factor1-zeros": dict(
        decoder_block_out_channels=(4, 8, 16),
        decoder_layers_per_block=(2, 1, 1, 1),
        upsample_type=("temporal", "spatial", "spatiotemporal"),
        upsample_residual=False,
        upsample_factor=(1, 1, 1),
        decoder_causal=False,
        decoder_spatial_padding_mode="zeros",
        patch_size=2,
    ),
    # a block without upsampler and replicate padding
    "noscale-replicate": dict(
        decoder_block_out_channels=(8, 8, 8),
        decoder_layers_per_block=(1, 1, 1, 1),
        decoder_spatio_temporal_scaling=(True, False, True),
        upsample_type=("spatiotemporal", "spatial", "temporal"),
        upsample_residual=(False, False, True),  # encoder order: residual on the first one
        upsample_factor=(1, 1, 1),
        decoder_spatial_padding_mode="replicate",
    ),
}
LATENT_CHANNELS = 8
TIMESTEP = 0.05
SEED = 7
# diffusers' decode at the tests' timestep (unless a test says otherwise), its noise seeded like ours
reference_decode = partial(helpers.ltx_decode, timestep=TIMESTEP, seed=SEED)


def _config(ref: AutoencoderKLLTX2Video) -> dict:
    config = {k: v for k, v in ref.config.items() if not k.startswith("_")}
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
    return {**config, "version": "ltx2"}


def make_pair(variant: str) -> tuple[AutoencoderKLLTX2Video, ltx.Decoder]:
    config = dict(latent_channels=LATENT_CHANNELS, **ENCODER, **VARIANTS[variant])
    ref = seeded(AutoencoderKLLTX2Video, **config)
    helpers.noise_scales_count(ref)
    ours = ltx.Decoder(_config(ref)).eval()
    ours.load_state_dict(decoder_state(ref))
    return ref, ours


def clip(frames: int, h: int = 3, w: int = 4, batch: int = 1) -> torch.Tensor:
    return latent(batch, LATENT_CHANNELS, frames, h, w, seed=frames * 100 + h * 10 + w)


@pytest.mark.parametrize("shape", [(1, 3, 4), (2, 2, 5), (3, 4, 3)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_matches_diffusers(variant, shape):
    ref, ours = make_pair(variant)
    assert ours.version == "ltx2"
    frames, h, w = shape
    z = clip(frames, h, w, batch=2 if frames == 2 else 1)
    expected = reference_decode(ref, z)
    # 3 latent frames run as 3 temporal chunks with state carried across them
    got = ours.decode(z, timestep=TIMESTEP, seed=SEED, chunk_frames=1 if frames == 3 else 2)
    assert got.shape == expected.shape
    assert got.shape[2] == ours.frames_out(frames)
    assert report(f"{variant} {list(z.shape)}", got, expected) >= 0.99999
    assert (got - expected).abs().max() < 1e-4


@pytest.mark.parametrize("variant", ["released", "kinds-causal", "factor1-zeros"])
def test_temporal_chunks_are_exact(variant):
    _, ours = make_pair(variant)
    helpers.check_temporal_chunks(variant, ours, clip(4, 2, 3), timestep=TIMESTEP, seed=SEED)


def test_causal_first_frame_is_independent_of_later_frames():
    """Causal: output frames of latent frame 0 do not change with what follows."""
    _, ours = make_pair("kinds-causal")
    z = clip(3)
    z2 = z.clone()
    z2[:, :, 1:] = latent(1, LATENT_CHANNELS, 2, 3, 4, seed=99)
    a = ours.decode(z, timestep=TIMESTEP, seed=SEED)
    b = ours.decode(z2, timestep=TIMESTEP, seed=SEED)
    assert torch.equal(a[:, :, :1], b[:, :, :1])
    assert (a[:, :, -1] - b[:, :, -1]).abs().max() > 1e-3


def test_timestep_default_and_effect():
    ref, ours = make_pair("kinds-causal")
    z = clip(1)
    assert torch.equal(ours.decode(z, seed=SEED), ours.decode(z, timestep=0.0, seed=SEED))
    got = ours.decode(z, timestep=0.5, seed=SEED)
    assert report("timestep=0.5", got, reference_decode(ref, z, timestep=0.5)) >= 0.99999


def test_tiled_is_blended_within_bound():
    """Blended spatial tiles vs the untiled decode (trained-like weights); diffusers' own
    tiling at the same geometry is the yardstick."""
    ref, ours = make_pair("released")
    ltx.init_synthetic(ours, torch.Generator().manual_seed(0))
    ref.decoder.load_state_dict(ours.state_dict())
    z = clip(2, 4, 6)
    whole = ours.decode(z, seed=SEED)
    tiled = ours.decode(z, seed=SEED, tiled=True, tile_size=4, tile_overlap=2)
    assert report("untiled vs diffusers", whole, reference_decode(ref, z)) >= 0.99999
    ref.enable_tiling(128, 128, None, 64, 64)  # the same geometry: 4-cell tiles, 2-cell stride
    ref_tiled = reference_decode(ref, z)
    ours_cos = report("ours tiled vs untiled", tiled, whole)
    ref_cos = report("diffusers tiled vs untiled", ref_tiled, whole)
    assert ours_cos >= max(ref_cos, 0.95)


def test_geometry_stages_and_dispatch():
    _, ours = make_pair("kinds-causal")  # one spatial, one temporal, one both
    assert (ours.spatial_scale, ours.temporal_scale, ours.frames_out(3)) == (16, 4, 9)
    _, released = make_pair("released")
    assert (released.spatial_scale, released.temporal_scale, released.frames_out(3)) == (32, 8, 17)
    probe = ours.probe_latent(torch.Generator().manual_seed(0))
    phases = helpers.stage_phases(ours, probe, seed=0)
    assert phases == ["condition", "conv_in", "mid", "up_0", "up_1", "up_2", "conv_out"]
    image = ours.decode(probe[:, :, 0], seed=0)
    assert torch.equal(image, ours.decode(probe[:, :, :1], seed=0)[:, :, 0])
    # no "version": the 0.9.x decoder, as every stored ltx model before LTX-2
    assert type(ltx.Decoder(ltx.SYNTHETIC["ltx-tiny"])) is ltx.Decoder
    assert ltx.Decoder(ltx.SYNTHETIC["ltx2-tiny"]).version == "ltx2"
    assert ours.summary()["version"] == "ltx2" and ours.summary()["padding_mode"] == "reflect"
    with pytest.raises(ValueError, match="upsample_type"):
        ltx.Decoder({**_config(make_pair("released")[0]), "upsample_type": ["diagonal"] * 3})


def test_synthetic_is_deterministic_and_json():
    config = ltx.SYNTHETIC["ltx2-tiny"]
    helpers.synthetic_twins(ltx, config, seed=3)
    assert json.loads(json.dumps(config)) == config


# --- conversion ---------------------------------------------------------------------------
def _check_converted(ref: AutoencoderKLLTX2Video, ours: ltx.Decoder, config: dict, name: str):
    """``ours``, converted from ``ref``, is an LTX-2 decoder that decodes and de-normalizes
    as diffusers does."""
    assert ours.version == "ltx2" and config["version"] == "ltx2"
    z = clip(2)
    got = ours.decode(z, timestep=TIMESTEP, seed=SEED)
    assert report(f"{name} converted", got, reference_decode(ref, z)) >= 0.99999
    expected = LTX2Pipeline._denormalize_latents(
        z, ref.latents_mean, ref.latents_std, ref.config.scaling_factor
    )
    assert torch.allclose(ours.denormalize(z), expected)


@pytest.mark.parametrize("variant", VARIANTS)
def test_convert_diffusers_folder(variant, tmp_path):
    ref = with_stats(make_pair(variant)[0])
    _, ours, config = helpers.import_pair(ref, ltx, tmp_path / "pipe")
    assert ltx.convert(tmp_path / "pipe" / "vae")[0] == config
    _check_converted(ref, ours, config, variant)


def lightricks_file(ref: AutoencoderKLLTX2Video, extra: dict | None = None) -> tuple[dict, dict]:
    """The decoder in Lightricks' flat ``up_blocks.N`` layout, with its ``config.vae``."""
    c = ref.config
    residual, factor = list(reversed(c.upsample_residual)), list(reversed(c.upsample_factor))
    layers, noise = (
        list(reversed(c.decoder_layers_per_block)),
        list(reversed(c.decoder_inject_noise)),
    )
    kinds = {
        "spatiotemporal": "compress_all",
        "spatial": "compress_space",
        "temporal": "compress_time",
    }
    blocks = [("mid_block", ["res_x", {"num_layers": layers[0], "inject_noise": noise[0]}])]
    for i, block in enumerate(ref.decoder.up_blocks):
        assert block.conv_in is None
        if block.upsamplers is not None:
            params = {"residual": residual[i], "multiplier": factor[i]}
            blocks.append((f"up_blocks.{i}.upsamplers.0", [kinds[c.upsample_type[i]], params]))
        blocks.append(
            (
                f"up_blocks.{i}",
                ["res_x", {"num_layers": layers[i + 1], "inject_noise": noise[i + 1]}],
            )
        )
    tensors = {}
    for key, value in decoder_state(ref).items():
        tensors["vae.decoder." + helpers.lightricks_decoder_name(key, blocks)] = value.contiguous()
    tensors["vae.per_channel_statistics.mean-of-means"] = ref.latents_mean.clone()
    tensors["vae.per_channel_statistics.std-of-means"] = ref.latents_std.clone()
    tensors["vae.per_channel_statistics.channel"] = torch.arange(LATENT_CHANNELS)
    tensors["vae.encoder.conv_out.conv.weight"] = torch.zeros(1, 8, 1, 1, 1)
    vae = {
        "_class_name": "CausalVideoAutoencoder",
        "decoder_blocks": [kind for _, kind in reversed(blocks)],  # listed encoder-side first
        "patch_size": c.patch_size,
        "causal_decoder": c.decoder_causal,
        "timestep_conditioning": c.timestep_conditioning,
        "spatial_padding_mode": c.decoder_spatial_padding_mode,
        "encoder_spatial_padding_mode": "zeros",
        "norm_layer": "pixel_norm",
    }
    return {**tensors, **(extra or {})}, {"config": json.dumps({"vae": vae})}


AUDIO_PARTS = {
    "audio_vae.per_channel_statistics.mean-of-means": torch.zeros(8),
    "audio_vae.decoder.conv_in.conv.weight": torch.zeros(4, 8, 3, 3),
    "vocoder.conv_pre.weight": torch.zeros(4, 8, 7),
    "model.diffusion_model.audio_scale_shift_table": torch.zeros(2, 4),
}


@pytest.mark.parametrize("variant", ["released", "kinds-causal", "noscale-replicate"])
def test_convert_lightricks_single_file(variant, tmp_path):
    ref = with_stats(make_pair(variant)[0])
    tensors, meta = lightricks_file(ref, AUDIO_PARTS)  # a full checkpoint: audio parts too
    if variant == "released":  # diffusers' own converter agrees on every decoder name
        theirs = convert_ltx2_vae_to_diffusers(
            {k: v for k, v in tensors.items() if k.startswith("vae.")}
        )
        assert {k for k in theirs if k.startswith("decoder.")} == {
            "decoder." + k for k in decoder_state(ref)
        }
    path = tmp_path / "ltx-2-19b-dev.safetensors"
    save_file(tensors, str(path), metadata=meta)
    config, state = ltx.convert(path)
    folder_config, folder_state = ltx.convert(helpers.saved(ref, tmp_path / "vae"))
    assert state.keys() == folder_state.keys()
    assert all(torch.equal(state[k], folder_state[k]) for k in state)
    assert ltx2_spec(config) == ltx2_spec(folder_config)
    _check_converted(
        ref, helpers.decoder_from(ltx, config, state), config, f"{variant} single file"
    )
