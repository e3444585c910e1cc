"""Where MiniMax-H3 weights come from: diffusers' ``AutoencoderKLMiniMaxH3`` layout
(``to_q/to_k/to_v``), the original fused ``vvae.*`` file, and seeded synthetic weights."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from app.families.minimax_h3.decoder.model import DEFAULTS


def config_from_diffusers(cfg: dict[str, Any]) -> dict[str, Any]:
    """Our config from an ``AutoencoderKLMiniMaxH3`` ``config.json``."""
    out = {k: cfg[k] for k in DEFAULTS if k in cfg}
    out["patch_size"] = math.prod(cfg.get("spatial_downsample_factors", (2, 2, 2, 2, 1, 1)))
    out["patch_size_t"] = math.prod(cfg.get("temporal_downsample_factors", (1, 2, 2, 1, 1, 1)))
    return {**DEFAULTS, **out}


def config_from_original(cfg: dict[str, Any], ffn_mult: int) -> dict[str, Any]:
    """Our config from the original ``vvae`` config keys (the seed's defaults)."""
    dim, heads = int(cfg.get("dim", 2048)), int(cfg.get("heads", 32))
    return {
        **DEFAULTS,
        "latent_channels": int(cfg.get("z_channels", 24)),
        "patch_size": int(cfg.get("patch_size", 16)),
        "patch_size_t": int(cfg.get("patch_size_t", 4)),
        "decoder_num_layers": int(cfg.get("num_layers", 36)),
        "decoder_num_attention_heads": heads,
        "decoder_attention_head_dim": dim // heads,
        "decoder_num_register_tokens": int(cfg.get("num_register_tokens", 4)),
        "decoder_ffn_mult": ffn_mult,
        "decoder_rope_theta": float(cfg.get("rope_theta", 100.0)),
        "decoder_rope_dim_ratio": float(cfg.get("rope_dim_ratio", 0.75)),
        "decoder_rope_axes": min(max(int(cfg.get("rope_dims", 3)), 2), 3),
        "decoder_norm_eps": float(cfg.get("eps", 1e-5)),
    }


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(config, decoder state dict)`` from a diffusers folder (``vae/`` or a
    pipeline root) or an original single file with ``vvae.*`` names."""
    source = Path(source)
    if source.is_dir() and (source / "vae" / "config.json").exists():
        source = source / "vae"
    files = _weight_files(source) if source.is_dir() else [source]
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(f))
    folder = source if source.is_dir() else source.parent
    if any(k.startswith("vvae.") for k in state):
        return _convert_original(state, folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} is needed beside diffusers-layout weights")
    config = config_from_diffusers(json.loads(config_path.read_text()))
    keep = ("decoder.", "post_quant_conv.")
    return config, {k: v for k, v in state.items() if k.startswith(keep)}


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors of a folder: the shard index, the default file, or all."""
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.exists():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        return [folder / s for s in sorted(shards)]
    if (folder / "diffusion_pytorch_model.safetensors").exists():
        return [folder / "diffusion_pytorch_model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors under {folder}")
    return files


_ORIGINAL_NAMES = {
    "post_quant_conv.weight": "post_quant_conv.weight",
    "post_quant_conv.bias": "post_quant_conv.bias",
    "x_embedder.weight": "decoder.proj_in.weight",
    "x_embedder.bias": "decoder.proj_in.bias",
    "register_tokens": "decoder.register_tokens",
    "norm_out.weight": "decoder.norm_out.weight",
    "norm_out.bias": "decoder.norm_out.bias",
    "proj_out.weight": "decoder.proj_out.weight",
    "proj_out.bias": "decoder.proj_out.bias",
}
_ORIGINAL_BLOCK_NAMES = {
    "norm1": "norm1.weight",
    "norm1.weight": "norm1.weight",
    "norm2": "norm2.weight",
    "norm2.weight": "norm2.weight",
    "scale1": "scale1",
    "scale2": "scale2",
    "attn.to_out.weight": "attn.to_out.0.weight",
    "attn.to_out.bias": "attn.to_out.0.bias",
    "ff.w2.weight": "ff.net.2.weight",
    "ff.w2.bias": "ff.net.2.bias",
}


def _convert_original(state: dict[str, Tensor], folder: Path) -> tuple[dict, dict[str, Tensor]]:
    """The seed's fused layout: per-head interleaved ``to_qkv``, ``[gate; value]`` ``w1``."""
    vvae = {k.removeprefix("vvae."): v for k, v in state.items() if k.startswith("vvae.")}
    if "config_json" in vvae:
        raw = json.loads(vvae.pop("config_json").to(torch.uint8).numpy().tobytes().decode())
    elif (folder / "config.json").exists():
        raw = json.loads((folder / "config.json").read_text())
    else:
        raise FileNotFoundError("no vvae.config_json tensor and no config.json beside it")
    dim = vvae["x_embedder.weight"].shape[0]
    config = config_from_original(raw, vvae["blocks.0.ff.w1.weight"].shape[0] // (2 * dim))
    heads = config["decoder_num_attention_heads"]
    for stat in ("latents_mean", "latents_std"):
        if stat in vvae:
            config[stat] = vvae.pop(stat).float().flatten().tolist()

    out: dict[str, Tensor] = {}
    for name, value in vvae.items():
        if name in _ORIGINAL_NAMES:
            out[_ORIGINAL_NAMES[name]] = value
        elif name.startswith("blocks."):
            out.update(_convert_block_tensor(name, value, heads))
        # anything else (enc.*, quant_conv.*) is the encoder half: not ours
    c = config["latent_channels"]
    out["post_quant_conv.weight"] = out["post_quant_conv.weight"].reshape(c, c, 1, 1, 1)
    out["decoder.proj_in.weight"] = out["decoder.proj_in.weight"].reshape(dim, c)
    out["decoder.register_tokens"] = out["decoder.register_tokens"].reshape(1, -1, dim)
    return config, out


def _convert_block_tensor(name: str, value: Tensor, heads: int) -> dict[str, Tensor]:
    _, index, rest = name.split(".", 2)
    prefix = f"decoder.transformer_blocks.{index}."
    if rest in _ORIGINAL_BLOCK_NAMES:
        target = _ORIGINAL_BLOCK_NAMES[rest]
        return {prefix + target: value.flatten() if target.startswith("scale") else value}
    if rest.startswith("attn.to_qkv."):
        # rows are [head0: q k v, head1: q k v, ...]
        kind = rest.rsplit(".", 1)[1]
        q, k, v = value.unflatten(0, (heads, 3, -1)).unbind(1)
        return {
            f"{prefix}attn.to_{n}.{kind}": t.flatten(0, 1).contiguous()
            for n, t in zip("qkv", (q, k, v), strict=True)
        }
    if rest.startswith("ff.w1."):
        gate, val = value.chunk(2, dim=0)
        return {f"{prefix}ff.net.0.proj.{rest.rsplit('.', 1)[1]}": torch.cat((val, gate))}
    raise KeyError(f"unexpected tensor vvae.{name} in an original MiniMax-H3 VAE file")


# --- synthetic weights -----------------------------------------------------------
