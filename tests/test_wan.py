"""The wan family against diffusers 0.42.1 (the oracle): ``AutoencoderKLWan`` (Wan 2.1 and
Wan 2.2 TI2V configurations) and ``AutoencoderKLQwenImage``, random weights, float32 CPU.

Each config is ``save_pretrained`` and imported with ``wan.convert`` (so the converter is on
the path of every parity number); the original single-file layouts are checked against
diffusers' own ``convert_wan_vae_to_diffusers`` where it knows them (Wan 2.1).
"""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from safetensors.torch import save_file

from app.families import ops
from app.families.wan import decoder as wan
from app.runtime import modes
from tests import helpers
from tests.helpers import check, cosine, import_pair, seeded, synthetic_twins

_WAN21 = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
CONFIGS = {
    "wan2.1": (AutoencoderKLWan, _WAN21),
    # one temporal upsampler (in the first up block), two resnets + 1 per block
    "wan2.1-t1": (
        AutoencoderKLWan,
        dict(
            _WAN21,
            dim_mult=[1, 2, 4, 4],
            base_dim=4,
            num_res_blocks=2,
            temperal_downsample=[False, False, True],
        ),
    ),  # fmt: skip
    "wan2.2": (
        AutoencoderKLWan,
        dict(
            _WAN21,
            z_dim=48,
            decoder_base_dim=8,
            **helpers.WAN22_PATCHED,
            scale_factor_spatial=16,
            latents_mean=[0.1] * 48,
            latents_std=[0.7] * 48,
        ),
    ),  # fmt: skip
    "qwen-image": (AutoencoderKLQwenImage, dict(_WAN21, base_dim=8)),
}
SHAPES = [(1, 1, 3, 4), (1, 2, 3, 4), (2, 5, 4, 3)]  # (batch, latent frames, h, w)
CL = torch.channels_last
latent = partial(helpers.latent, seed=1)  # seed 1 unless a test says otherwise


@torch.no_grad()
def reference(name: str, seed: int = 0) -> AutoencoderKLWan | AutoencoderKLQwenImage:
    """A random diffusers VAE: default init, RMSNorm gains and attention made non-trivial."""
    cls, kwargs = CONFIGS[name]
    vae = seeded(cls, seed, **kwargs)
    for pname, p in vae.decoder.named_parameters():
        if pname.endswith("gamma"):
            p.uniform_(0.5, 1.5)
        elif pname.endswith("proj.weight"):
            p.normal_(0, 0.2)
    return vae


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    """name -> (diffusers VAE, our decoder imported from its saved folder, config)."""
    return {
        name: import_pair(reference(name), wan, tmp_path_factory.mktemp(name)) for name in CONFIGS
    }


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@torch.no_grad()
def test_decode_matches_diffusers(pairs, name, shape):
    ref, ours, config = pairs[name]
    b, t, h, w = shape
    z = latent(b, config["z_dim"], t, h, w)
    expected = helpers.checked_reference_decode(ref, ours, z)
    for chunk in (1, 2, 0):  # latent frames per streamed chunk (0: the whole clip at once)
        got = ours.decode(z, chunk_frames=chunk)
        check(f"{name} {shape} chunk {chunk}", got, expected)


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_served_cpu_copy_is_channels_last_3d_and_matches_diffusers(pairs, name):
    """The served float32 CPU copy (``modes.build``: 3-D conv weights in channels_last_3d,
    its own tensors, upsamplers by output phase) decodes as diffusers does, streamed or not, and leaves the reference be."""
    ref, ours, config = pairs[name]
    served = modes.build(ours, torch.device("cpu"), modes.Mode(torch.float32))
    assert served.conv_in.weight.is_contiguous(memory_format=torch.channels_last_3d)
    phases = [m for m in served.modules() if isinstance(m, ops.PhaseConv)]
    assert phases and all(p.phase_weights[0, 0].is_contiguous(memory_format=CL) for p in phases)
    assert ours.conv_in.weight.is_contiguous()
    norms = [m for m in served.modules() if isinstance(m, wan.model.RMSNorm)]
    assert norms and all(isinstance(m, wan.fast.ChannelsLastRMSNorm) for m in norms)
    z = latent(1, config["z_dim"], 3, 4, 3, seed=3)
    expected = ref.decode(z).sample
    for chunk in (1, 0):
        check(f"{name} served chunk {chunk}", served.decode(z, chunk_frames=chunk), expected)


@pytest.mark.parametrize("video", [True, False])
@torch.no_grad()
def test_channels_last_rms_norm_is_the_norm(video):
    """The fast path's RMSNorm computes the reference's, zero positions included, from
    LayerNorm statistics where the channels are innermost and by the reference elsewhere."""
    norm = wan.model.RMSNorm(24, video=video)
    norm.gamma.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
    fast = wan.fast.ChannelsLastRMSNorm(norm)
    shape, layout = ((2, 24, 3, 5, 4), torch.channels_last_3d) if video else ((2, 24, 5, 4), CL)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    x[0, :, 0] = 0  # a frame (or row) of all-zero positions: 0, not NaN
    for dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 2e-2)):
        for inner in (True, False):
            xi = (x.contiguous(memory_format=layout) if inner else x).to(dtype)
            assert (ops.channel_mean_square(xi) is not None) == inner
            got, want = fast.to(dtype)(xi), norm.to(dtype)(xi)
            assert got.dtype == dtype and not got.isnan().any()
            torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)
            assert got.is_contiguous(memory_format=layout) == inner


def test_fused_statistics_only_on_the_cpu():
    """CUDA's LayerNorm refuses a float32 weight beside a bf16 input (the H200 proof of
    2026-12-04, the channels_last_3d layout): off the CPU the norm takes the reference's
    reduction, even where the channels are innermost."""
    x = torch.empty(2, 24, 3, 5, 4, dtype=torch.bfloat16, device="meta")
    assert ops.channel_mean_square(x.contiguous(memory_format=torch.channels_last_3d)) is None


@pytest.mark.parametrize("name", ["wan2.1", "wan2.2"])
@torch.no_grad()
def test_stream_yields_frames_in_order(pairs, name):
    ref, ours, config = pairs[name]
    z = latent(1, config["z_dim"], 4, 3, 3, seed=2)
    expected = ref.decode(z).sample
    chunks = list(ours.iter_decode(z, chunk_frames=1))
    # the first latent frame makes one frame; each later one temporal_scale frames
    assert [c.shape[2] for c in chunks] == [1] + [ours.temporal_scale] * 3
    check(f"{name} streamed", torch.cat(chunks, 2), expected)


@pytest.mark.parametrize("name", ["wan2.1", "wan2.2", "qwen-image"])
@torch.no_grad()
def test_tiled_matches_diffusers_tiled(pairs, name):
    """Our tiles and in-place blends are diffusers' ``tiled_decode``'s (small tiles here:
    4-cell latent tiles every 3 cells), streamed or not."""
    ref, ours, config = pairs[name]
    ratio = config["spatial_compression_ratio"]
    size, stride = 4 * ratio, 3 * ratio
    ref.enable_tiling(size, size, stride, stride)
    try:
        z = latent(1, config["z_dim"], 2, 7, 9, seed=3)
        expected = ref.decode(z).sample
    finally:
        ref.disable_tiling()
    untiled = ours.decode(z)
    for chunk in (1, 0):
        got = ours.decode(
            z, tiled=True, tile_sample_size=size, tile_sample_stride=stride, chunk_frames=chunk
        )
        check(f"{name} tiled chunk {chunk}", got, expected)
    assert cosine(untiled, expected) < 0.9999  # the tiles are really there (seams differ)
    assert torch.equal(ours.decode(z, tiled=False), untiled)


@torch.no_grad()
def test_image_latent_is_one_frame(pairs):
    ref, ours, config = pairs["qwen-image"]
    z = latent(1, 16, 1, 4, 5, seed=4)
    expected = ref.decode(z).sample[:, :, 0]
    got = ours.decode(z[:, :, 0])  # [B,C,H,W] -> [B,3,H,W]
    check("qwen-image 4-D", got, expected)


@pytest.mark.parametrize("name", ["wan2.1", "wan2.2", "qwen-image"])
def test_denormalize_is_the_pipelines(pairs, name):
    """WanPipeline / QwenImagePipeline: ``z / (1 / std) + mean`` per channel."""
    ref, ours, config = pairs[name]
    z = latent(1, config["z_dim"], 2, 2, 2, seed=5)
    mean = torch.tensor(ref.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(ref.config.latents_std).view(1, -1, 1, 1, 1)
    assert torch.allclose(ours.denormalize(z), z / inv_std + mean, atol=1e-6)


def test_geometry(pairs):
    assert (pairs["wan2.1"][1].spatial_scale, pairs["wan2.1"][1].temporal_scale) == (8, 4)
    assert (pairs["wan2.1-t1"][1].spatial_scale, pairs["wan2.1-t1"][1].temporal_scale) == (8, 2)
    assert (pairs["wan2.2"][1].spatial_scale, pairs["wan2.2"][1].temporal_scale) == (16, 4)
    assert pairs["wan2.2"][1].frames_out(21) == 81
    assert pairs["qwen-image"][2]["variant"] == "qwen-image"


# --- original single files -------------------------------------------------------------------
def original_wan21(state: dict[str, torch.Tensor], blocks: int, per_block: int) -> dict:
    """diffusers' Wan 2.1 decoder names -> the original ``Wan2.1_VAE.pth`` layout (a flat
    ``decoder.upsamples.N`` list: each block's resnets, then its resample)."""
    resnet = {"norm1.": "residual.0.", "conv1.": "residual.2.", "norm2.": "residual.3.",
              "conv2.": "residual.6.", "conv_shortcut.": "shortcut."}  # fmt: skip
    top = {"post_quant_conv.": "conv2.", "quant_conv.": "conv1.",
           "decoder.conv_in.": "decoder.conv1.", "decoder.norm_out.": "decoder.head.0.",
           "decoder.conv_out.": "decoder.head.2.", "decoder.mid_block.resnets.0.": "decoder.middle.0.",
           "decoder.mid_block.attentions.0.": "decoder.middle.1.",
           "decoder.mid_block.resnets.1.": "decoder.middle.2."}  # fmt: skip
    for i in range(blocks):
        for j in range(per_block):
            top[f"decoder.up_blocks.{i}.resnets.{j}."] = (
                f"decoder.upsamples.{i * (per_block + 1) + j}."
            )
        top[f"decoder.up_blocks.{i}.upsamplers.0."] = (
            f"decoder.upsamples.{i * (per_block + 1) + per_block}."
        )
    out = {}
    for key, value in state.items():
        if key.startswith("encoder."):
            out[key] = value  # kept: the real files hold the encoder too
            continue
        for new, old in top.items():
            if key.startswith(new):
                rest = key[len(new) :]
                for a, b in resnet.items():
                    rest = b + rest[len(a) :] if rest.startswith(a) else rest
                key = old + rest
                break
        out[key] = value
    return out


def original_wan22(state: dict[str, torch.Tensor], per_block: int) -> dict:
    """diffusers' Wan 2.2 names -> ``Wan2.2_VAE.pth``'s nested ``upsamples.i.upsamples.j``."""
    out = {}
    for key, value in original_wan21(state, 0, 0).items():
        if key.startswith("decoder.up_blocks."):
            parts = key.split(".")
            i = parts[2]
            if parts[3] == "upsampler":
                key = f"decoder.upsamples.{i}.upsamples.{per_block}." + ".".join(parts[4:])
            else:
                j, rest = parts[4], ".".join(parts[5:])
                for a, b in {"norm1.": "residual.0.", "conv1.": "residual.2.",
                             "norm2.": "residual.3.", "conv2.": "residual.6.",
                             "conv_shortcut.": "shortcut."}.items():  # fmt: skip
                    rest = b + rest[len(a) :] if (rest + ".").startswith(a) else rest
                key = f"decoder.upsamples.{i}.upsamples.{j}.{rest}"
        out[key] = value
    return out


def test_original_wan21_layout_is_diffusers_own(pairs):
    """Our test writer of the original layout agrees with diffusers' single-file converter
    (which hard-codes Wan 2.1's 4 blocks x 3 resnets), so it is a fair source below."""
    ref = AutoencoderKLWan(base_dim=4, z_dim=16, num_res_blocks=2).eval()
    state = ref.state_dict()
    theirs = convert_wan_vae_to_diffusers(original_wan21(state, 4, 3))
    decoder_keys = {k for k in state if k.startswith(("decoder.", "post_quant_conv."))}
    assert decoder_keys <= theirs.keys()


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
@pytest.mark.parametrize("name", ["wan2.1", "wan2.1-t1", "wan2.2"])
@torch.no_grad()
def test_convert_original_single_file(pairs, name, suffix, tmp_path):
    ref, ours, config = pairs[name]
    per_block = CONFIGS[name][1]["num_res_blocks"] + 1
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    if config["is_residual"]:
        original = original_wan22(state, per_block)
    else:
        original = original_wan21(state, len(ref.decoder.up_blocks), per_block)
    path = tmp_path / f"Wan_VAE{suffix}"
    if suffix == ".pth":
        torch.save(original, path)
    else:
        save_file(original, str(path))
    got_config, got_state = wan.convert(path)
    assert got_state.keys() == ours.state_dict().keys()
    decoder = wan.Decoder(got_config).eval()
    decoder.load_state_dict(got_state)
    z = latent(1, config["z_dim"], 2, 3, 3, seed=6)
    check(f"{name} from {suffix}", decoder.decode(z), ref.decode(z).sample)
    for key in ("is_residual", "patch_size", "temperal_downsample", "num_res_blocks"):
        assert got_config[key] == config[key], key


def test_published_stats_for_original_files(tmp_path):
    """A single file has no config: the published Wan 2.1 (16 ch) / 2.2 (48 ch) statistics."""
    ref = AutoencoderKLWan(base_dim=4, z_dim=16, num_res_blocks=1, dim_mult=[1, 1, 1, 1])
    path = tmp_path / "wan_2.1_vae.safetensors"
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    save_file(original_wan21(state, 4, 2), str(path))
    config, _ = wan.convert(path)
    assert config["latents_mean"] == list(ref.config.latents_mean)
    assert config["latents_std"] == list(ref.config.latents_std)
    assert config["variant"] == "wan2.1" and config["fps"] == 16


# --- refusals ----------------------------------------------------------------------------------
def test_refuses_other_classes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLQwenImage21"}))
    with pytest.raises(ValueError, match="'AutoencoderKLQwenImage21' is not a Wan VAE"):
        wan.convert(tmp_path)


def test_refuses_unknown_and_missing_keys(pairs, tmp_path):
    ref, _, _ = pairs["wan2.1"]
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    path = tmp_path / "odd.safetensors"
    save_file({**state, "decoder.up_blocks.0.resnets.0.extra.weight": torch.zeros(1)}, str(path))
    with pytest.raises(ValueError, match="unexpected .*extra.weight"):
        wan.convert(path)
    del state["decoder.conv_out.bias"]
    save_file(state, str(path))
    with pytest.raises(ValueError, match="missing .*conv_out.bias"):
        wan.convert(path)
    save_file({"decoder.up_blocks.0.resnets.0.conv1.conv.weight": torch.zeros(1)}, str(path))
    with pytest.raises(ValueError, match="not a Wan VAE"):
        wan.convert(path)


def test_refuses_unknown_latent_width(tmp_path):
    ref = AutoencoderKLWan(base_dim=4, z_dim=8, num_res_blocks=1, dim_mult=[1, 1, 1, 1])
    path = tmp_path / "wan_like.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    with pytest.raises(ValueError, match="8 latent channels: no published"):
        wan.convert(path)


# --- synthetic models --------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(wan.SYNTHETIC))
@pytest.mark.bf16_kernels
def test_synthetic_is_deterministic_and_gates_in_bf16(name):
    config = wan.SYNTHETIC[name]
    a, b = synthetic_twins(wan, config, seed=0)
    json.dumps(config)
    z = a.probe_latent(torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = a.eval().decode(z)
        fast = b.eval().to(torch.bfloat16).decode(z.to(torch.bfloat16))
    check(f"{name} bf16 vs fp32 (gate probe)", fast.float(), exact, min_cos=0.9999)


def _viewing_causal(self, conv, x, frames):
    """The carry as it was: a view into the concatenated input (pins all of it)."""
    prev = self.carry.get(conv)
    seq = (
        torch.nn.functional.pad(x, (0, 0, 0, 0, frames, 0))
        if prev is None
        else torch.cat([prev, x], 2)
    )
    self.carry[conv] = seq[:, :, seq.shape[2] - frames :]
    return seq


def test_cache_carry_is_a_copy_lowering_the_peak_not_the_output(monkeypatch):
    """Each conv's 2-frame carry is copied out of the chunk it came from: the peak (live
    tensors on the meta device, Wan 2.1 at full width) drops, the decode does not change."""
    from bench.meta_memory import live_peak

    config = {**wan.SYNTHETIC["wan2.1-tiny"], "decoder_base_dim": 96, "num_res_blocks": 2}
    with torch.device("meta"):
        big = wan.Decoder(config).to(torch.bfloat16).eval()
    z = torch.empty((1, 16, 5, 30, 52), device="meta", dtype=torch.bfloat16)
    copied = live_peak(lambda: big.decode(z))
    tiny = wan.Decoder(wan.SYNTHETIC["wan2.1-tiny"]).eval()
    wan.init_synthetic(tiny, torch.Generator().manual_seed(0))
    zt = latent(1, 16, 5, 4, 6)
    with torch.inference_mode():
        out_copied = tiny.decode(zt)
    monkeypatch.setattr(wan.model.FrameCache, "causal", _viewing_causal)
    viewed = live_peak(lambda: big.decode(z))
    with torch.inference_mode():
        out_viewed = tiny.decode(zt)
    assert copied < 0.75 * viewed, (copied / 2**20, viewed / 2**20)
    assert torch.equal(out_copied, out_viewed)


def test_the_mid_attention_never_holds_a_score_matrix():
    """A frame's self-attention in memory linear in its pixels: at 96 x 96 latent pixels an
    L x L float32 score matrix is 324 MiB (a 2048^2 image's: 16 GiB, what killed a server)."""
    from torch.profiler import ProfilerActivity, profile

    block = wan.model.AttentionBlock(4).eval()
    x = torch.randn(1, 4, 1, 96, 96)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        block(x)
    largest = max(op.self_cpu_memory_usage for op in prof.key_averages())
    assert largest < 16 << 20, f"an op allocated {largest >> 20} MiB"
