"""Wan / Qwen-Image checkpoints -> (config, decoder state dict in canonical names).

Canonical names are diffusers' decoder names without the ``decoder.`` prefix, plus
``post_quant_conv``. Sources:
  * a diffusers ``vae/`` folder (or a pipeline folder holding one) of ``AutoencoderKLWan``
    (Wan 2.1, Wan 2.2) or ``AutoencoderKLQwenImage``: config.json + safetensors;
  * the original single files: ``Wan2.1_VAE.pth`` / ``Wan2.2_VAE.pth`` (pickles, read with
    ``torch.load(weights_only=True)``) or their safetensors repacks (ComfyUI's
    ``wan_2.1_vae`` / ``wan2.2_vae`` / ``qwen_image_vae``), keys ``decoder.middle.*``,
    ``decoder.upsamples.*``, ``decoder.head.*``, ``conv2`` (the post-quant conv). Their
    config is inferred from the weight shapes; latent statistics are the published ones.
Anything else (another class, unknown or missing keys, wrong shapes) is refused, named.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from app.families import ops
from app.families.checkpoint import decoder_part, read_tensors, state_mismatch
from app.families.wan.decoder.model import Architecture

# Published latent statistics (diffusers' AutoencoderKLWan defaults = Wan 2.1 = Qwen-Image;
# Wan 2.2 from Wan-Video/Wan2.2's Wan2_2_VAE).
WAN21_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
              0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]  # fmt: skip
WAN21_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
             3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]  # fmt: skip
WAN22_MEAN = [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
              -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
              -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
              -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
              -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
              0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667]  # fmt: skip
WAN22_STD = [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
             0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
             0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
             0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
             0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
             0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]  # fmt: skip
KNOWN_STATS = {16: (WAN21_MEAN, WAN21_STD), 48: (WAN22_MEAN, WAN22_STD)}
FPS = {"wan2.1": 16, "wan2.2": 24, "qwen-image": 16}  # the pipelines' export defaults
CLASSES = ("AutoencoderKLWan", "AutoencoderKLQwenImage")
PREFIXES = ("vae.", "first_stage_model.")


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A diffusers folder or an original single file -> (config, canonical state dict)."""
    source = Path(source)
    if source.is_dir():
        config, state = _from_folder(source)
    else:
        config, state = _from_single_file(source)
    check_state(config, state, source)
    return config, state


# --- diffusers folders ----------------------------------------------------------------------
def _from_folder(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    folder = source / "vae" if (source / "vae" / "config.json").exists() else source
    raw = json.loads((folder / "config.json").read_text())
    name = raw.get("_class_name")
    if name not in CLASSES:
        raise ValueError(
            f"{folder}: _class_name {name!r} is not a Wan VAE; the wan family decodes "
            f"{' and '.join(CLASSES)}"
        )
    tensors = ops.read_safetensors_folder(folder)
    state = decoder_part(tensors, folder, "Wan")
    return (_qwen_config(raw) if name == "AutoencoderKLQwenImage" else _wan_config(raw)), state


def _wan_config(raw: dict[str, Any]) -> dict[str, Any]:
    residual = bool(raw.get("is_residual", False))
    variant = "wan2.2" if residual else "wan2.1"
    return {
        "variant": variant,
        "z_dim": raw.get("z_dim", 16),
        "decoder_base_dim": raw.get("decoder_base_dim") or raw.get("base_dim", 96),
        "dim_mult": list(raw.get("dim_mult", [1, 2, 4, 4])),
        "num_res_blocks": raw.get("num_res_blocks", 2),
        "temperal_downsample": list(raw.get("temperal_downsample", [False, True, True])),
        "is_residual": residual,
        "out_channels": raw.get("out_channels", 3),
        "patch_size": raw.get("patch_size"),
        "spatial_compression_ratio": raw.get("scale_factor_spatial") or 8,
        "latents_mean": list(raw.get("latents_mean", WAN21_MEAN)),
        "latents_std": list(raw.get("latents_std", WAN21_STD)),
        "fps": FPS[variant],
    }


def _qwen_config(raw: dict[str, Any]) -> dict[str, Any]:
    temporal = list(raw.get("temperal_downsample", [False, True, True]))
    return {
        "variant": "qwen-image",
        "z_dim": raw.get("z_dim", 16),
        "decoder_base_dim": raw.get("base_dim", 96),
        "dim_mult": list(raw.get("dim_mult", [1, 2, 4, 4])),
        "num_res_blocks": raw.get("num_res_blocks", 2),
        "temperal_downsample": temporal,
        "is_residual": False,
        "out_channels": raw.get("input_channels", 3),
        "patch_size": None,
        "spatial_compression_ratio": 2 ** len(temporal),  # as AutoencoderKLQwenImage tiles
        "tiled_clamp": False,  # its tiled_decode does not clamp (its one-pass decode does)
        "latents_mean": list(raw.get("latents_mean", WAN21_MEAN)),
        "latents_std": list(raw.get("latents_std", WAN21_STD)),
        "fps": FPS["qwen-image"],
    }


# --- original single files --------------------------------------------------------------------
def _from_single_file(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    tensors = _read_file(path)
    if "decoder.middle.0.residual.0.gamma" in tensors:
        state = _from_original(tensors, path)
    elif "decoder.mid_block.resnets.0.norm1.gamma" in tensors:
        state = decoder_part(tensors, path, "Wan")
    else:
        raise ValueError(
            f"{path}: not a Wan VAE (no decoder.middle.* or decoder.mid_block.* keys; "
            f"saw e.g. {sorted(tensors)[:5]})"
        )
    return _infer_config(state, path), state


def _read_file(path: Path) -> dict[str, Tensor]:
    """A single file's tensors (``read_tensors``), each ``vae.``-style prefix that every key
    has dropped."""
    tensors = read_tensors(path)
    for prefix in PREFIXES:
        if tensors and all(k.startswith(prefix) for k in tensors):
            tensors = {k[len(prefix) :]: v for k, v in tensors.items()}
    return tensors


# Original resnet internals: residual = [norm1, SiLU, conv1, norm2, SiLU, Dropout, conv2]
_RESNET = {"residual.0.": "norm1.", "residual.2.": "conv1.", "residual.3.": "norm2.",
           "residual.6.": "conv2.", "shortcut.": "conv_shortcut."}  # fmt: skip
_TOP = {"conv2.": "post_quant_conv.", "decoder.conv1.": "conv_in.",
        "decoder.middle.0.": "mid_block.resnets.0.", "decoder.middle.1.": "mid_block.attentions.0.",
        "decoder.middle.2.": "mid_block.resnets.1.", "decoder.head.0.": "norm_out.",
        "decoder.head.2.": "conv_out."}  # fmt: skip
_FLAT = re.compile(r"^decoder\.upsamples\.(\d+)\.(.+)$")  # Wan 2.1: one flat list
_NESTED = re.compile(r"^decoder\.upsamples\.(\d+)\.upsamples\.(\d+)\.(.+)$")  # Wan 2.2


def _from_original(tensors: dict[str, Tensor], path: Path) -> dict[str, Tensor]:
    """Original Wan names -> canonical names (the encoder and ``conv1`` dropped)."""
    nested = any(_NESTED.match(k) for k in tensors)
    flat_targets = {} if nested else _flat_targets(tensors)
    rename = partial(_rename, nested=nested, flat_targets=flat_targets)
    return renamed(tensors, ("encoder.", "conv1."), rename, path, "decoder")


def renamed(
    tensors: dict[str, Tensor],
    dropped: tuple[str, ...],
    rename: Callable[[str], str | None],
    where: Path,
    half: str,
) -> dict[str, Tensor]:
    """``tensors`` under ``rename``'s names, the keys under ``dropped`` (the other half) left
    out; a key ``rename`` has no name for is refused, named (the encoder's convert too)."""
    state, unknown = {}, []
    for key, value in tensors.items():
        if key.startswith(dropped):
            continue
        name = rename(key)
        if name is None:
            unknown.append(key)
        else:
            state[name] = value
    if unknown:
        raise ValueError(f"{where}: keys the Wan {half} does not have: {sorted(unknown)[:5]}")
    return state


def _flat_targets(tensors: dict[str, Tensor]) -> dict[int, str]:
    """Wan 2.1's ``decoder.upsamples.N`` -> ``up_blocks.i.resnets.j`` / ``.upsamplers.0``:
    a block is its resnets closed by a resample (the last block has none)."""
    kinds = {}
    for key in tensors:
        if m := _FLAT.match(key):
            rest = m.group(2)
            kinds[int(m.group(1))] = "up" if rest.startswith(("resample.", "time_conv.")) else "res"
    targets, block, j = {}, 0, 0
    for n in sorted(kinds):
        if kinds[n] == "up":
            targets[n] = f"up_blocks.{block}.upsamplers.0."
            block, j = block + 1, 0
        else:
            targets[n] = f"up_blocks.{block}.resnets.{j}."
            j += 1
    return targets


def _rename(key: str, nested: bool, flat_targets: dict[int, str]) -> str | None:
    for old, new in _TOP.items():
        if key.startswith(old):
            return resnet_part(new, key[len(old) :])
    if nested and (m := _NESTED.match(key)):
        i, j, rest = int(m.group(1)), int(m.group(2)), m.group(3)
        if rest.startswith(("resample.", "time_conv.")):
            return f"up_blocks.{i}.upsampler.{rest}"
        return resnet_part(f"up_blocks.{i}.resnets.{j}.", rest)
    if not nested and (m := _FLAT.match(key)):
        return resnet_part(flat_targets[int(m.group(1))], m.group(2))
    return None


def resnet_part(prefix: str, rest: str) -> str:
    """``prefix`` + an original resnet's ``rest`` in diffusers' names (the encoder's convert
    renames with it too)."""
    for old, new in _RESNET.items():
        if rest.startswith(old):
            return prefix + new + rest[len(old) :]
    return prefix + rest


def _infer_config(state: dict[str, Tensor], path: Path) -> dict[str, Any]:
    """The diffusers config that builds exactly these weights."""
    z = state["conv_in.weight"].shape[1]
    residual = any(".upsampler." in k for k in state)
    blocks = sorted({int(k.split(".")[1]) for k in state if k.startswith("up_blocks.")})
    outs = [state[f"up_blocks.{i}.resnets.0.conv1.weight"].shape[0] for i in blocks]
    ups = "upsampler" if residual else "upsamplers.0"
    temporal = [f"up_blocks.{i}.{ups}.time_conv.weight" in state for i in blocks[:-1]]
    resnets = len({k.split(".")[3] for k in state if k.startswith("up_blocks.0.resnets.")})
    base = outs[-1]
    if any(o % base for o in outs):
        raise ValueError(f"{path}: up block widths {outs} are not multiples of the last")
    out_ch = state["conv_out.weight"].shape[0]
    patch = 2 if out_ch == 12 else None
    if z not in KNOWN_STATS:
        raise ValueError(f"{path}: {z} latent channels: no published Wan latent statistics")
    mean, std = KNOWN_STATS[z]
    variant = "wan2.2" if residual else "wan2.1"
    return {
        "variant": variant,
        "z_dim": z,
        "decoder_base_dim": base,
        "dim_mult": [o // base for o in reversed(outs)],
        "num_res_blocks": resnets - 1,
        "temperal_downsample": list(reversed(temporal)),
        "is_residual": residual,
        "out_channels": out_ch,
        "patch_size": patch,
        "spatial_compression_ratio": 2 ** len(temporal) * (patch or 1),
        "latents_mean": list(mean),
        "latents_std": list(std),
        "fps": FPS[variant],
    }


def check_state(config: dict[str, Any], state: dict[str, Tensor], source: Path) -> None:
    """The converted names and shapes must be exactly the decoder's (checked on meta)."""
    with torch.device("meta"):
        decoder = Architecture(config)
    if problem := state_mismatch(decoder, state):
        raise ValueError(
            f"{source}: the Wan checkpoint does not fit its config ({config['variant']}): {problem}"
        )
