"""HunyuanVideo VAE checkpoints -> (config, decoder state dict in canonical names).

Canonical names are diffusers' decoder names without the ``decoder.`` prefix, plus
``post_quant_conv``. The original checkpoint (Tencent's ``hyvideo/vae``,
``AutoencoderKLCausal3D``) already uses these names: it was built from diffusers' blocks
(``CausalConv3d.conv``, ``Attention`` with ``to_q/to_k/to_v/to_out.0``); its
``pytorch_model.pt`` nests them as ``{"state_dict": {"vae.decoder...": ...}}``. Sources:
  * a diffusers ``vae/`` folder (or a pipeline folder holding one) of
    ``AutoencoderKLHunyuanVideo``: config.json + safetensors;
  * the original folder (config.json of ``AutoencoderKLCausal3D`` + ``pytorch_model.pt``)
    or its single file ``pytorch_model.pt`` (read with ``torch.load(weights_only=True)``) /
    a safetensors repack (``hunyuan_video_vae_bf16.safetensors``): keys with or without
    ``vae.`` (as the original loader: when any key has it, only ``vae.*`` keys are read).
    Without a config.json beside it the config is inferred from the weight shapes, with the
    published values the weights cannot show (32 norm groups, 8x space, 4x time).
Anything else (another class, other block types, unknown or missing keys, wrong shapes) is
refused, named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from app.families import ops
from app.families.checkpoint import decoder_part, state_mismatch
from app.families.hunyuan_video.decoder.model import Architecture, up_factors

SCALING_FACTOR = 0.476986  # HunyuanVideo's published latent scale
FPS = 24  # HunyuanVideo's frame rate
DIFFUSERS_CLASS = "AutoencoderKLHunyuanVideo"
ORIGINAL_CLASS = "AutoencoderKLCausal3D"
UP_BLOCKS = {DIFFUSERS_CLASS: "HunyuanVideoUpBlock3D", ORIGINAL_CLASS: "UpDecoderBlockCausal3D"}
WEIGHT_FILES = ("pytorch_model.pt", "pytorch_model.safetensors", "pytorch_model.pth")


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A diffusers folder, the original folder or an original single file -> (config, state)."""
    source = Path(source)
    if source.is_dir():
        folder, raw = config_folder(source)
        if raw.get("_class_name") == ORIGINAL_CLASS:
            path = original_weights(folder)
            config, state = _config(raw, folder), _decoder_part(_read_file(path), path)
        else:
            config = _config(raw, folder)
            state = _decoder_part(ops.read_safetensors_folder(folder), folder)
    else:
        state = _decoder_part(_read_file(source), source)
        raw = config_beside(source)
        config = _infer_config(state, source) if raw is None else _config(raw, source.parent)
    check_state(config, state, source)
    return config, state


# --- what the encoder's convert reads the same way (app/families/hunyuan_video/encoder/convert.py) ---
def config_folder(source: Path) -> tuple[Path, dict[str, Any]]:
    """The folder of ``source`` that holds the VAE's config.json (``source``, or its ``vae/``
    in a pipeline folder), and that config."""
    folder = source / "vae" if (source / "vae" / "config.json").exists() else source
    return folder, json.loads((folder / "config.json").read_text())


def config_beside(path: Path) -> dict[str, Any] | None:
    """The config.json beside a single file, or None when there is none."""
    beside = path.parent / "config.json"
    return json.loads(beside.read_text()) if beside.exists() else None


def original_weights(folder: Path) -> Path:
    """The weight file of an original (``AutoencoderKLCausal3D``) folder: the first of
    ``WEIGHT_FILES`` there."""
    path = next((folder / f for f in WEIGHT_FILES if (folder / f).exists()), None)
    if path is None:
        raise ValueError(f"{folder}: an {ORIGINAL_CLASS} config without {WEIGHT_FILES}")
    return path


def without_vae_prefix(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """As hyvideo's ``load_vae`` reads a checkpoint: when any key has ``vae.``, only the
    ``vae.*`` keys, without it."""
    if any(k.startswith("vae.") for k in tensors):
        return {k[len("vae.") :]: v for k, v in tensors.items() if k.startswith("vae.")}
    return tensors


def _config(raw: dict[str, Any], where: Path) -> dict[str, Any]:
    """A diffusers or original config -> the canonical config; what we cannot decode exactly
    (another class, other block types or activation) is refused, named."""
    name = raw.get("_class_name")
    if name not in UP_BLOCKS:
        raise ValueError(
            f"{where}: _class_name {name!r} is not a HunyuanVideo VAE; the hunyuan-video family "
            f"decodes {DIFFUSERS_CLASS} (and the original {ORIGINAL_CLASS})"
        )
    widths = list(raw.get("block_out_channels", (128, 256, 512, 512)))
    blocks = list(raw.get("up_block_types") or [UP_BLOCKS[name]] * len(widths))
    if any(b != UP_BLOCKS[name] for b in blocks) or len(blocks) != len(widths):
        raise ValueError(f"{where}: up_block_types {blocks}: expected {UP_BLOCKS[name]} each")
    if raw.get("act_fn", "silu") not in ("silu", "swish"):
        raise ValueError(f"{where}: act_fn {raw['act_fn']!r}: HunyuanVideo uses silu")
    if raw.get("norm_type", "group") != "group":
        raise ValueError(f"{where}: norm_type {raw['norm_type']!r}: only GroupNorm is decoded")
    temporal = raw.get("temporal_compression_ratio", raw.get("time_compression_ratio", 4))
    config = {
        "latent_channels": raw.get("latent_channels", 16),
        "out_channels": raw.get("out_channels", 3),
        "block_out_channels": widths,
        "layers_per_block": raw.get("layers_per_block", 2),
        "norm_num_groups": raw.get("norm_num_groups", 32),
        "spatial_compression_ratio": raw.get("spatial_compression_ratio", 8),
        "temporal_compression_ratio": temporal,
        "mid_block_add_attention": bool(raw.get("mid_block_add_attention", True)),
        "scaling_factor": raw.get("scaling_factor", SCALING_FACTOR),
        "fps": FPS,
    }
    try:
        up_factors(len(widths), config["spatial_compression_ratio"], temporal)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return config


def _read_file(path: Path) -> dict[str, Tensor]:
    """Tensors of a safetensors file, or of a pickled ``.pt``/``.pth`` read with
    ``weights_only=True`` (no code runs); ``{"state_dict": ...}`` and ``vae.`` unwrapped."""
    if path.suffix in (".pt", ".pth", ".ckpt"):
        loaded = torch.load(str(path), map_location="cpu", weights_only=True)
        if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
            loaded = loaded["state_dict"]
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a pickle of {type(loaded).__name__}, not a state dict")
        tensors = {k: v for k, v in loaded.items() if isinstance(v, Tensor)}
    else:
        tensors = load_file(str(path))
    return without_vae_prefix(tensors)


def _decoder_part(tensors: dict[str, Tensor], where: Path) -> dict[str, Tensor]:
    """The decoder's tensors (canonical names); the encoder's are dropped, others refused."""
    if "decoder.conv_in.conv.weight" not in tensors:
        raise ValueError(
            f"{where}: not a HunyuanVideo VAE (no decoder.conv_in.conv.weight; saw e.g. "
            f"{sorted(tensors)[:5]})"
        )
    return decoder_part(tensors, where, "HunyuanVideo")


def _infer_config(state: dict[str, Tensor], path: Path) -> dict[str, Any]:
    """The config that builds exactly these weights, published values for what they cannot
    show (norm groups, where the upsamplers double time or space); a topology those values
    do not place is refused."""
    blocks = sorted({int(k.split(".")[1]) for k in state if k.startswith("up_blocks.")})
    widths = [state[f"up_blocks.{i}.resnets.0.conv1.conv.weight"].shape[0] for i in blocks]
    resnets = len({k.split(".")[3] for k in state if k.startswith("up_blocks.0.resnets.")})
    config = {
        "_class_name": DIFFUSERS_CLASS,
        "latent_channels": state["conv_in.conv.weight"].shape[1],
        "out_channels": state["conv_out.conv.weight"].shape[0],
        "block_out_channels": list(reversed(widths)),
        "layers_per_block": resnets - 1,
        "mid_block_add_attention": "mid_block.attentions.0.to_q.weight" in state,
    }
    config = _config(config, path)
    placed = [t or s for t, s in up_factors(len(blocks), 8, 4)]
    found = [f"up_blocks.{i}.upsamplers.0.conv.conv.weight" in state for i in blocks]
    if placed != found:
        raise ValueError(
            f"{path}: upsamplers in up blocks {[i for i in blocks if found[i]]}, where "
            f"HunyuanVideo (8x space, 4x time) puts them in {[i for i in blocks if placed[i]]}; "
            f"put its config.json beside the file"
        )
    return config


def check_state(config: dict[str, Any], state: dict[str, Tensor], source: Path) -> None:
    """The converted names and shapes must be exactly the decoder's (checked on meta)."""
    try:
        with torch.device("meta"):
            decoder = Architecture(config)
    except ValueError as exc:  # e.g. widths the norm groups do not divide
        raise ValueError(f"{source}: config {config}: {exc}") from None
    if problem := state_mismatch(decoder, state):
        raise ValueError(
            f"{source}: the HunyuanVideo checkpoint does not fit its config: {problem}"
        )
