"""Where Wan encoder weights come from:
  * a diffusers ``vae/`` folder (``AutoencoderKLWan``: Wan 2.1, Wan 2.2 TI2V;
    ``AutoencoderKLQwenImage``); the config keeps diffusers' encoder keys, ``variant`` says
    which model it is;
  * the original single files ``Wan2.1_VAE.pth`` / ``Wan2.2_VAE.pth`` (read with
    ``weights_only=True``) or their safetensors repacks (ComfyUI's ``wan_2.1_vae``,
    ``wan2.2_vae``, ``qwen_image_vae``): keys ``encoder.conv1``, ``encoder.downsamples.*``
    (Wan 2.2: ``encoder.downsamples.i.downsamples.j``), ``encoder.middle.*``,
    ``encoder.head.*``, ``conv1`` (the quant conv). Their config is inferred from the
    weight shapes; latent statistics are the published ones.
Anything that does not fit the encoder exactly is refused, named."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torch import Tensor

from app.families import encoding
from app.families.wan.decoder.convert import (
    KNOWN_STATS,
    PREFIXES,
    WAN21_MEAN,
    WAN21_STD,
    renamed,
    resnet_part,
)
from app.families.wan.encoder.encode import DEFAULTS, Encoder

CLASSES = ("AutoencoderKLWan", "AutoencoderKLQwenImage")


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    source = Path(source)
    config, state = _from_folder(source) if source.is_dir() else _from_single_file(source)
    encoding.check_state(Encoder, config, state, source)
    return config, state


def _from_folder(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    raw, tensors = encoding.read_vae_folder(source)
    name = raw.get("_class_name")
    if name not in CLASSES:
        raise ValueError(f"{source}: _class_name {name!r} is not one of {', '.join(CLASSES)}")
    config = {k: raw.get(k, v) for k, v in DEFAULTS.items()}
    if name == "AutoencoderKLQwenImage":
        temporal = list(raw.get("temperal_downsample", DEFAULTS["temperal_downsample"]))
        config.update(
            variant="qwen-image",
            in_channels=raw.get("input_channels", 3),
            is_residual=False,
            patch_size=None,
            spatial_compression_ratio=2 ** len(temporal),  # as its tiled_encode measures
        )
    else:
        config["variant"] = "wan2.2" if raw.get("is_residual") else "wan2.1"
        config["spatial_compression_ratio"] = raw.get("scale_factor_spatial") or 8
    config["latents_mean"] = list(raw.get("latents_mean", WAN21_MEAN))
    config["latents_std"] = list(raw.get("latents_std", WAN21_STD))
    return encoding.jsonable(config), encoding.encoder_state(tensors)


# --- original single files --------------------------------------------------------------------
# resnets are renamed as the decoder's convert does (``resnet_part``)
_TOP = {"conv1.": "quant_conv.", "encoder.conv1.": "encoder.conv_in.",
        "encoder.middle.0.": "encoder.mid_block.resnets.0.",
        "encoder.middle.1.": "encoder.mid_block.attentions.0.",
        "encoder.middle.2.": "encoder.mid_block.resnets.1.",
        "encoder.head.0.": "encoder.norm_out.", "encoder.head.2.": "encoder.conv_out."}  # fmt: skip
_NESTED = re.compile(r"^encoder\.downsamples\.(\d+)\.downsamples\.(\d+)\.(.+)$")  # Wan 2.2
_FLAT = re.compile(r"^encoder\.downsamples\.(\d+)\.(.+)$")  # Wan 2.1: one flat list
_RESAMPLE = ("resample.", "time_conv.")


def _from_single_file(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    tensors = encoding.read_single_file(path, PREFIXES)
    if "encoder.middle.0.residual.0.gamma" in tensors:
        state = _from_original(tensors, path)
    elif "encoder.mid_block.resnets.0.norm1.gamma" in tensors:
        state = encoding.encoder_state(tensors)
    else:
        raise ValueError(
            f"{path}: no Wan encoder (no encoder.middle.* or encoder.mid_block.* keys; "
            f"saw e.g. {sorted(tensors)[:5]})"
        )
    return _infer_config(state, path), state


def _from_original(tensors: dict[str, Tensor], path: Path) -> dict[str, Tensor]:
    """Original Wan names -> diffusers' (the decoder and ``conv2`` dropped)."""
    return renamed(tensors, ("decoder.", "conv2."), _rename, path, "encoder")


def _rename(key: str) -> str | None:
    for old, new in _TOP.items():
        if key.startswith(old):
            return resnet_part(new, key[len(old) :])
    if m := _NESTED.match(key):
        i, j, rest = m.groups()
        if rest.startswith(_RESAMPLE):
            return f"encoder.down_blocks.{i}.downsampler.{rest}"
        return resnet_part(f"encoder.down_blocks.{i}.resnets.{j}.", rest)
    if m := _FLAT.match(key):  # the flat list keeps its indices in diffusers
        return resnet_part(f"encoder.down_blocks.{m.group(1)}.", m.group(2))
    return None


def _stages(state: dict[str, Tensor], residual: bool) -> list[tuple[int, int, bool | None]]:
    """(output width, resnets, temporal downsampling or None: no downsampler) per stage."""
    blocks = sorted({int(k.split(".")[2]) for k in state if k.startswith("encoder.down_blocks.")})
    stages: list[tuple[int, int, bool | None]] = []
    if residual:
        for i in blocks:
            p = f"encoder.down_blocks.{i}."
            resnets = len({k.split(".")[4] for k in state if k.startswith(p + "resnets.")})
            width = state[p + "resnets.0.conv1.weight"].shape[0]
            down = None
            if p + "downsampler.resample.1.weight" in state:
                down = p + "downsampler.time_conv.weight" in state
            stages.append((width, resnets, down))
        return stages
    width, resnets = 0, 0
    for i in blocks:
        p = f"encoder.down_blocks.{i}."
        if p + "resample.1.weight" in state:
            stages.append((width, resnets, p + "time_conv.weight" in state))
            resnets = 0
        else:
            width, resnets = state[p + "conv1.weight"].shape[0], resnets + 1
    stages.append((width, resnets, None))
    return stages


def _infer_config(state: dict[str, Tensor], path: Path) -> dict[str, Any]:
    """The diffusers config that builds exactly these weights."""
    z = state["quant_conv.weight"].shape[0] // 2
    cin, base = state["encoder.conv_in.weight"].shape[1], state["encoder.conv_in.weight"].shape[0]
    residual = any(".downsampler." in k for k in state)
    stages = _stages(state, residual)
    if any(w % base for w, _, _ in stages) or len({n for _, n, _ in stages}) != 1:
        raise ValueError(f"{path}: down stages {stages} do not fit a Wan encoder config")
    if z not in KNOWN_STATS:
        raise ValueError(f"{path}: {z} latent channels: no published Wan latent statistics")
    patch = 2 if cin == 12 else None
    mean, std = KNOWN_STATS[z]
    temporal = [bool(t) for _, _, t in stages[:-1]]
    return {
        **DEFAULTS,
        "variant": "wan2.2" if residual else "wan2.1",
        "base_dim": base,
        "z_dim": z,
        "dim_mult": [w // base for w, _, _ in stages],
        "num_res_blocks": stages[0][1],
        "temperal_downsample": temporal,
        "is_residual": residual,
        "in_channels": cin,
        "patch_size": patch,
        "spatial_compression_ratio": 2 ** len(temporal) * (patch or 1),
        "latents_mean": list(mean),
        "latents_std": list(std),
    }
