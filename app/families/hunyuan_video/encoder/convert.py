"""Where HunyuanVideo encoder weights come from (canonical names: diffusers' ``encoder.*``
and ``quant_conv.*``, which Tencent's original checkpoint shares):
  * a diffusers ``vae/`` folder (or a pipeline folder holding one) of
    ``AutoencoderKLHunyuanVideo``;
  * the original folder (config.json of ``AutoencoderKLCausal3D`` + ``pytorch_model.pt``) or
    a single file (``pytorch_model.pt``, read with ``weights_only=True``, or a safetensors
    repack), keys with or without ``vae.`` (when any key has it, only ``vae.*`` are read, as
    the original loader does). Without a config.json beside it the config is inferred from
    the weight shapes and the published values they cannot show (32 norm groups, 8x space,
    4x time).
Anything that does not fit the encoder exactly is refused, named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from app.families import encoding
from app.families.hunyuan_video.decoder.convert import (
    DIFFUSERS_CLASS,
    ORIGINAL_CLASS,
    config_beside,
    config_folder,
    original_weights,
    without_vae_prefix,
)
from app.families.hunyuan_video.encoder.encode import DEFAULTS, SCALING_FACTOR, Encoder

DOWN_BLOCKS = {
    DIFFUSERS_CLASS: "HunyuanVideoDownBlock3D",
    ORIGINAL_CLASS: "DownEncoderBlockCausal3D",
}


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    source = Path(source)
    if source.is_dir():
        folder, raw = config_folder(source)
        if raw.get("_class_name") == ORIGINAL_CLASS:
            path = original_weights(folder)
            config, state = _config(raw, folder), _encoder_part(_read_file(path), path)
        else:
            raw, tensors = encoding.read_vae_folder(folder)
            config, state = _config(raw, folder), _encoder_part(tensors, folder)
    else:
        state = _encoder_part(_read_file(source), source)
        raw = config_beside(source)
        config = _infer_config(state) if raw is None else _config(raw, source.parent)
    try:
        encoding.check_state(Encoder, config, state, source)
    except ValueError as exc:  # e.g. widths the norm groups do not divide
        raise ValueError(f"{source}: config {config}: {exc}") from None
    return config, state


def _config(raw: dict[str, Any], where: Path) -> dict[str, Any]:
    """A diffusers or original config -> the encoder's; what it cannot encode exactly is
    refused, named."""
    name = raw.get("_class_name")
    if name not in DOWN_BLOCKS:
        raise ValueError(
            f"{where}: _class_name {name!r} is not a HunyuanVideo VAE "
            f"({DIFFUSERS_CLASS} or the original {ORIGINAL_CLASS})"
        )
    widths = list(raw.get("block_out_channels", DEFAULTS["block_out_channels"]))
    blocks = list(raw.get("down_block_types") or [DOWN_BLOCKS[name]] * len(widths))
    if any(b != DOWN_BLOCKS[name] for b in blocks) or len(blocks) != len(widths):
        raise ValueError(f"{where}: down_block_types {blocks}: expected {DOWN_BLOCKS[name]} each")
    if raw.get("act_fn", "silu") not in ("silu", "swish"):
        raise ValueError(f"{where}: act_fn {raw['act_fn']!r}: HunyuanVideo uses silu")
    if raw.get("norm_type", "group") != "group":
        raise ValueError(f"{where}: norm_type {raw['norm_type']!r}: only GroupNorm is encoded")
    temporal = raw.get("temporal_compression_ratio", raw.get("time_compression_ratio", 4))
    return {
        **{k: raw.get(k, v) for k, v in DEFAULTS.items()},
        "block_out_channels": widths,
        "temporal_compression_ratio": temporal,
        "mid_block_add_attention": bool(raw.get("mid_block_add_attention", True)),
        "scaling_factor": raw.get("scaling_factor", SCALING_FACTOR),
    }


def _read_file(path: Path) -> dict[str, Tensor]:
    return without_vae_prefix(encoding.read_single_file(path))


def _encoder_part(tensors: dict[str, Tensor], where: Path) -> dict[str, Tensor]:
    if "encoder.conv_in.conv.weight" not in tensors:
        raise ValueError(
            f"{where}: no HunyuanVideo encoder (no encoder.conv_in.conv.weight; saw e.g. "
            f"{sorted(tensors)[:5]}): a decoder-only checkpoint?"
        )
    state = encoding.encoder_state(tensors)
    unknown = [
        k for k in tensors if k not in state and not k.startswith(("decoder.", "post_quant"))
    ]
    unknown = [k for k in unknown if not k.startswith("loss.")]  # a training leftover
    if unknown:
        raise ValueError(f"{where}: keys of no HunyuanVideo VAE part: {sorted(unknown)[:5]}")
    return state


def _infer_config(state: dict[str, Tensor]) -> dict[str, Any]:
    """The config that builds exactly these weights, with the published values for what
    they cannot show; ``check_state`` refuses any that still do not fit."""
    blocks = sorted({int(k.split(".")[2]) for k in state if k.startswith("encoder.down_blocks.")})
    widths = [
        state[f"encoder.down_blocks.{i}.resnets.0.conv1.conv.weight"].shape[0] for i in blocks
    ]
    p = "encoder.down_blocks.0.resnets."
    resnets = len({k.split(".")[4] for k in state if k.startswith(p)})
    return {
        **DEFAULTS,
        "in_channels": state["encoder.conv_in.conv.weight"].shape[1],
        "latent_channels": state["quant_conv.weight"].shape[0] // 2,
        "block_out_channels": widths,
        "layers_per_block": resnets,
        "mid_block_add_attention": "encoder.mid_block.attentions.0.to_q.weight" in state,
    }
