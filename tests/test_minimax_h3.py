"""MiniMax-H3 ViT3D decoder against diffusers' AutoencoderKLMiniMaxH3.decode (tiling on)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3
from safetensors.torch import save_file
from torch import nn

from app.families.minimax_h3 import decoder as mm
from app.families.minimax_h3.decoder import fast as mm_fast
from app.families.minimax_h3.decoder import schedule
from app.families.minimax_h3.decoder.convert import config_from_diffusers
from app.runtime import modes
from app.telemetry import timing
from app.telemetry.timing import PhaseTimer
from tests.helpers import check, cosine, latent, seeded

C = 4  # latent channels of the tiny test configs


class SeedImageRope(nn.Module):
    """The seed's image-variant RoPE, (h, w) axes only: dropped into the oracle,
    which only knows the 3-axis video one."""

    def __init__(self, rope_dim: int, theta: float) -> None:
        super().__init__()
        k = rope_dim // 4  # rope_dim / (2 * axes) frequencies per axis
        self.inv = torch.tensor([1.0 / theta ** (i * 4 / rope_dim) for i in range(k)])

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = 2 * math.pi * pos[..., 1:, None] * self.inv  # drop t
        angles = angles.flatten(2).repeat(1, 1, 2).unsqueeze(2)
        return angles.cos(), angles.sin()


def reference(image: bool = False, layers: int = 2, seed: int = 0) -> AutoencoderKLMiniMaxH3:
    """A tiny oracle with every decoder weight random (layer scales non-zero)."""
    vae = seeded(
        AutoencoderKLMiniMaxH3,
        seed,
        latent_channels=C,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        spatial_downsample_factors=(2, 2, 2, 2),
        temporal_downsample_factors=(1, 1, 1, 1) if image else (1, 2, 2, 1),
        norm_num_groups=4,
        decoder_num_layers=layers,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=16,
        decoder_num_register_tokens=4,
        latents_mean=(0.1, -0.2, 0.3, 0.0),
        latents_std=(0.5, 1.5, 1.0, 2.0),
    )
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if not name.startswith(("decoder.", "post_quant_conv.")):
                continue
            noise = torch.randn(p.shape, generator=g)
            if name.endswith(("scale1", "scale2")):
                p.copy_(0.3 + 0.1 * noise)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            elif name.endswith(("bias", "register_tokens")):
                p.copy_(0.1 * noise if name.endswith("bias") else noise)
            else:
                p.copy_(noise / math.sqrt(p[0].numel()))
    if image:
        vae.decoder.rope = SeedImageRope(12, 100.0)
    return vae


def ours_from(vae: AutoencoderKLMiniMaxH3, image: bool = False) -> mm.Decoder:
    config = config_from_diffusers(dict(vae.config))
    if image:
        config["decoder_rope_axes"] = 2
    dec = mm.Decoder(config).eval()
    keep = ("decoder.", "post_quant_conv.")
    dec.load_state_dict({k: v for k, v in vae.state_dict().items() if k.startswith(keep)})
    return dec


VIDEO_CASES = {
    # name: latent [B, C, T, h, w]
    # 464 x 272 px: 3 x 2 tiles whose overlaps (160, 144) outgrow the middle tile's kept
    # 112 rows; one clip, 4 pad tokens
    "tiles3x2": (1, C, 3, 29, 17),
    "tiles2x1-chunks2": (1, C, 8, 17, 3),  # 2 tiles a clip, 2 clips, 4 pad tokens
    "batch2-chunks3": (2, C, 13, 3, 5),  # untiled, 3 clips
}


@pytest.fixture(scope="module")
def video_pair() -> tuple[AutoencoderKLMiniMaxH3, mm.Decoder]:
    vae = reference()
    return vae, ours_from(vae)


@pytest.mark.parametrize("case", VIDEO_CASES)
def test_video_matches_diffusers(case, video_pair):
    vae, ours = video_pair
    z = latent(*VIDEO_CASES[case], seed=1)
    with torch.no_grad():
        expected = vae.decode(z).sample
    got = ours.decode(z)
    assert got.shape[2] == ours.frames_out(z.shape[2])
    check(case, got, expected)


@pytest.mark.parametrize("frames", [1, 2])
def test_short_video_is_one_clip_minus_pre_pad(frames, video_pair):
    """diffusers cannot decode < 3 latent frames (it concatenates no chunks); we
    decode them as one clip and cut the pre-pad, its own `_decode_clip` path."""
    vae, ours = video_pair
    z = latent(1, C, frames, 18, 3, seed=1)
    with pytest.raises(ValueError):
        vae.decode(z)
    with torch.no_grad():
        expected = vae._decode_clip(z)[:, :, vae.frame_pre_padding :]
    got = ours.decode(z)
    assert got.shape[2] == ours.frames_out(frames) == 4 * frames - 3
    check(f"video-{frames}-frame", got, expected)


def test_image_variant_matches_tiled_clip():
    """MiniMax-H3-Image: patch_t 1, (h, w) RoPE; one frame through the spatial tiles."""
    vae = reference(image=True, seed=3)
    ours = ours_from(vae, image=True)
    assert ours.image and not ours.is_video
    for shape in [(1, C, 18, 20), (2, C, 5, 7)]:
        z = latent(*shape, seed=1)
        with torch.no_grad():
            expected = vae._decode_clip(z.unsqueeze(2)).squeeze(2)
        got = ours.decode(z)
        check(f"image-{shape[2]}x{shape[3]}-b{shape[0]}", got, expected)
    stack = latent(1, C, 2, 5, 7, seed=1)
    frames = ours.decode(stack)
    assert frames.shape == (1, 3, 2, 80, 112)
    torch.testing.assert_close(frames[:, :, 1], ours.decode(stack[:, :, 1]), rtol=0, atol=0)


def test_iter_decode_streams_what_decode_returns(video_pair):
    _, ours = video_pair
    timing.instrument(ours.stages())
    timer = PhaseTimer()
    z = latent(1, C, 12, 3, 4, seed=1)  # no padding: 2 clips -> 17, 17, then the 5-frame tail
    with timer.active():
        chunks = list(ours.iter_decode(z, max_batch_tokens=1))
    assert [c.shape[2] for c in chunks] == [17, 17, 5]
    torch.testing.assert_close(torch.cat(chunks, dim=2), ours.decode(z), rtol=0, atol=0)
    assert {"embed", "blocks", "head", "unpatchify", "chunk_blend"} <= set(timer.phases())
    z = latent(1, C, 13, 3, 4, seed=1)  # 4 pad tokens: the trim reaches into the last chunk
    chunks = list(ours.iter_decode(z))
    assert sum(c.shape[2] for c in chunks) == ours.frames_out(13) == 43
    torch.testing.assert_close(torch.cat(chunks, dim=2), ours.decode(z), rtol=0, atol=0)
    fine, profiled = PhaseTimer(), copy.deepcopy(ours)
    timing.instrument(profiled.fine_stages())
    with fine.active():
        profiled.decode(latent(1, C, 1, 18, 3, seed=1))
    assert {"norm", "qkv", "attention", "out", "ffn", "blocks", "tile_blend"} <= set(fine.phases())
    assert fine.phases()["blocks"] >= fine.phases()["ffn"]  # the fine phases nest inside


def original_file(config: dict, state: dict, path, config_in_tensor: bool) -> None:
    """The seed's fused layout, built by hand from our canonical weights."""
    heads = config["decoder_num_attention_heads"]
    dim = heads * config["decoder_attention_head_dim"]
    out = {
        "vvae.post_quant_conv.weight": state["post_quant_conv.weight"].flatten(1),
        "vvae.post_quant_conv.bias": state["post_quant_conv.bias"],
        "vvae.x_embedder.weight": state["decoder.proj_in.weight"],
        "vvae.x_embedder.bias": state["decoder.proj_in.bias"],
        "vvae.register_tokens": state["decoder.register_tokens"][0],
        "vvae.latents_mean": torch.tensor(config["latents_mean"]),
        "vvae.latents_std": torch.tensor(config["latents_std"]),
        "vvae.enc.conv_in.weight": torch.zeros(8, 3, 3, 3),  # encoder half: ignored
    }
    for part in ("norm_out.weight", "norm_out.bias", "proj_out.weight", "proj_out.bias"):
        out[f"vvae.{part}"] = state[f"decoder.{part}"]
    for i in range(config["decoder_num_layers"]):
        src, dst = f"decoder.transformer_blocks.{i}.", f"vvae.blocks.{i}."
        for name in ("norm1", "norm2"):
            out[dst + name] = state[src + name + ".weight"]
        for name in ("scale1", "scale2"):
            out[dst + name] = state[src + name]
        for kind in ("weight", "bias"):
            q, k, v = (state[f"{src}attn.to_{n}.{kind}"].unflatten(0, (heads, -1)) for n in "qkv")
            out[f"{dst}attn.to_qkv.{kind}"] = torch.cat((q, k, v), dim=1).flatten(0, 1)
            out[f"{dst}attn.to_out.{kind}"] = state[f"{src}attn.to_out.0.{kind}"]
            value, gate = state[f"{src}ff.net.0.proj.{kind}"].chunk(2)
            out[f"{dst}ff.w1.{kind}"] = torch.cat((gate, value))
            out[f"{dst}ff.w2.{kind}"] = state[f"{src}ff.net.2.{kind}"]
    raw = {
        "num_layers": config["decoder_num_layers"],
        "dim": dim,
        "heads": heads,
        "z_channels": C,
        "patch_size": 16,
        "patch_size_t": 4,
        "num_register_tokens": 4,
        "rope_theta": 100.0,
        "rope_dim_ratio": 0.75,
        "rope_dims": 3,
        "eps": 1e-5,
    }
    blob = json.dumps(raw).encode()
    if config_in_tensor:
        out["vvae.config_json"] = torch.tensor(list(blob), dtype=torch.uint8)
    else:
        (path.parent / "config.json").write_bytes(blob)
    save_file({k: v.contiguous() for k, v in out.items()}, path)


@pytest.mark.parametrize("config_in_tensor", [True, False])
def test_both_layouts_decode_identically(config_in_tensor, tmp_path):
    vae = reference(layers=2, seed=5)
    vae.save_pretrained(tmp_path / "pipe" / "vae")
    config, state = mm.convert(tmp_path / "pipe")
    assert not any(k.startswith(("encoder.", "quant_conv.")) for k in state)
    (tmp_path / "orig").mkdir()
    original_file(config, state, tmp_path / "orig" / "vae.safetensors", config_in_tensor)
    config2, state2 = mm.convert(tmp_path / "orig" / "vae.safetensors")
    assert state.keys() == state2.keys()
    for key in state:
        assert torch.equal(state[key], state2[key]), key
    for key in (
        "latent_channels",
        "patch_size",
        "patch_size_t",
        "decoder_num_layers",
        "decoder_num_attention_heads",
        "decoder_attention_head_dim",
        "decoder_ffn_mult",
    ):
        assert config[key] == config2[key], key
    torch.testing.assert_close(config["latents_std"], config2["latents_std"])
    a, b = mm.Decoder(config).eval(), mm.Decoder(config2).eval()
    a.load_state_dict(state)
    b.load_state_dict(state2)
    z = latent(1, C, 3, 4, 5, seed=1)
    torch.testing.assert_close(a.decode(z), b.decode(z), rtol=0, atol=0)
    with torch.no_grad():
        check("diffusers-folder", a.decode(z), vae.decode(z).sample)


def test_schedules_reproduce_the_seed():
    assert schedule.split_tiles(288, 16) == ([0, 32], [256, 256], [224])
    assert schedule.split_tiles(512, 16) == ([0, 128, 256], [256, 256, 256], [128, 128])
    assert schedule.split_tiles(256, 16)[0] == [0]
    assert schedule.split_tiles(128, 16)[1] == [128]
    plan = schedule.clip_plan(7, 4)
    assert (plan.chunk_frames, plan.pre_pad, plan.overlap) == (20, 3, 5)
    assert plan.clips == ((0, 7),)  # 5-token chunk + 2-token overlap
    # 17n + 5 frames <-> 5n + 2 latent frames; padded lengths are trimmed
    assert [schedule.clip_plan(t, 4).frames for t in (3, 7, 8, 12, 17)] == [9, 22, 26, 39, 56]


def reference_bf16(vae: AutoencoderKLMiniMaxH3) -> AutoencoderKLMiniMaxH3:
    """What ``from_pretrained(torch_dtype=bfloat16)`` builds (without needing
    accelerate): bf16 weights, the `_keep_in_fp32_modules` and RoPE buffer fp32."""
    low = copy.deepcopy(vae)
    keep = set(AutoencoderKLMiniMaxH3._keep_in_fp32_modules)
    for name, p in low.named_parameters():
        if not keep & set(name.split(".")):
            p.data = p.data.to(torch.bfloat16)
    return low


def test_bf16_matches_the_reference_mixed_precision(video_pair):
    """Norms, layer scales and the residual stream stay fp32, as in the reference."""
    vae, ours = video_pair
    low = copy.deepcopy(ours).to(dtype=torch.bfloat16)
    low = low.to(memory_format=torch.channels_last)  # what the service's fast path asks
    assert low.decoder.transformer_blocks[0].scale1.dtype == torch.float32
    assert low.decoder.norm_out.weight.dtype == torch.float32
    assert low.decoder.proj_out.weight.dtype == torch.bfloat16
    z = latent(1, C, 3, 17, 5, seed=1)
    with torch.no_grad():
        expected = reference_bf16(vae).decode(z).sample
    got = low.decode(z)
    assert got.dtype == expected.dtype == torch.bfloat16
    check("bf16-vs-reference-bf16", got, expected)


def test_denormalize_matches_the_pipeline():
    cfg = mm.SYNTHETIC["minimax-h3-tiny"]
    dec = mm.Decoder(cfg)
    z = latent(1, 24, 2, 3, 3, seed=1)
    mean = torch.tensor(cfg["latents_mean"]).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg["latents_std"]).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(dec.denormalize(z), z * std + mean, rtol=0, atol=0)


def test_synthetic_bf16_tracks_fp32():
    """The synthetic init is trained-like: bf16 stays within the parity gate."""
    dec = mm.Decoder(mm.SYNTHETIC["minimax-h3-tiny"]).eval()
    mm.init_synthetic(dec, torch.Generator().manual_seed(0))
    z = dec.probe_latent(torch.Generator().manual_seed(0))[..., :6, :5]
    ref = dec.decode(z)
    got = dec.to(torch.bfloat16).decode(z)
    print(f"synthetic bf16 vs fp32: cos={cosine(got, ref):.6f}")
    assert cosine(got, ref) >= 0.9999


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_served_copy_matches_diffusers(dtype, video_pair):
    """The served copy (``modes.build``: the fast blocks, norms and layer scales float32)
    against diffusers at the same precision; the caller's residual stream is left alone."""
    vae, ours = video_pair
    served = modes.build(ours, torch.device("cpu"), modes.Mode(dtype))
    blocks = served.decoder.transformer_blocks
    assert isinstance(blocks, mm_fast.FastBlocks) and len(blocks) == len(
        ours.decoder.transformer_blocks
    )
    assert blocks[0].scale1.dtype == blocks[0].norm1.weight.dtype == torch.float32
    assert blocks[0].ff.net[0].proj.weight.dtype == dtype
    assert served.decoder.norm_out.weight.dtype == torch.float32
    z = latent(1, C, 3, 17, 5, seed=1)
    with torch.no_grad():
        expected = (vae if dtype == torch.float32 else reference_bf16(vae)).decode(z).sample
    check(f"served-{dtype}", served.decode(z), expected)
    tokens = 2 + ours.config["decoder_num_register_tokens"] + 1  # a 1x1x2 grid + suffix
    x = torch.randn(1, tokens, blocks[0].norm1.normalized_shape[0])
    kept = x.clone()
    rope = ours.rope((1, 1, 2), x.device)
    with torch.no_grad():
        first, second = blocks(x, rope), blocks(x, rope)
    assert torch.equal(x, kept) and torch.equal(first, second)
