"""FLUX-family encoder checkpoints -> our names (diffusers' ``encoder.*`` minus the prefix,
plus ``quant_conv.*`` and FLUX.2's ``bn.running_*``).

Layouts: a diffusers ``vae/`` folder (or its pipeline folder) of ``AutoencoderKL`` /
``AutoencoderKLFlux2``, and Black Forest Labs' / LDM single files (``ae.safetensors``,
``encoder.down.{i}.block.{j}...``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from app.families.flux.decoder.convert import (
    LDM_FIXED,
    fixed_ldm_name,
    from_ldm,
    read_diffusers_folder,
    read_single_file,
)
from app.families.flux.encoder.model import ENCODER_CONFIG

# BFL / LDM single-file names -> ours, for the parts that are not per down block: the
# decoder's, and quant_conv, which FLUX.2's BFL file keeps inside the encoder
_LDM_FIXED = {**LDM_FIXED, "quant_conv": "quant_conv"}
_TOP_LEVEL = ("quant_conv.", "bn.running_mean", "bn.running_var")


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A diffusers ``vae/`` folder (or pipeline folder) or a BFL/LDM single file -> ours.
    ``ValueError`` when the checkpoint holds no encoder (a decoder-only export)."""
    source = Path(source)
    if source.is_dir():
        return _convert_diffusers_folder(source)
    return _convert_single_file(source)


def _convert_diffusers_folder(folder: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    raw, state = read_diffusers_folder(folder)
    out = {k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")}
    if not out:
        raise ValueError(f"{folder}: no encoder.* tensors: a decoder-only checkpoint")
    out.update({k: v for k, v in state.items() if k.startswith(_TOP_LEVEL)})
    config = {key: raw[key] for key in ENCODER_CONFIG if key in raw}
    if "scaling_factor" not in raw:  # diffusers' AutoencoderKL default, not FLUX.1's
        config["scaling_factor"] = 0.18215
    config["use_quant_conv"] = "quant_conv.weight" in out
    config["latent_bn"] = "bn.running_mean" in out
    if config["latent_bn"]:
        config["batch_norm_eps"] = raw.get("batch_norm_eps", 1e-4)
        config.update(scaling_factor=None, shift_factor=None)  # FLUX.2 normalises with bn
    config["source_class"] = raw.get("_class_name", "AutoencoderKL")
    return config, out


def _convert_single_file(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    raw = read_single_file(path, "encoder.")
    enc = {k.removeprefix("encoder."): v for k, v in raw.items() if k.startswith("encoder.")}
    if not enc:
        raise ValueError(f"{path}: no encoder.* tensors: a decoder-only checkpoint")
    state = from_ldm(enc, _ldm_name)
    state.update({k: v for k, v in raw.items() if k.startswith(_TOP_LEVEL)})
    return _infer_config(state), state


def _ldm_name(name: str) -> str:
    if (fixed := fixed_ldm_name(name, _LDM_FIXED)) is not None:
        return fixed
    parts = name.split(".")  # down.{i}.block.{j}.rest | down.{i}.downsample.conv
    if parts[0] != "down":
        raise ValueError(f"unexpected encoder tensor {name!r}")
    if parts[2] == "block":  # unlike the decoder's up blocks, down indices run in order
        rest = ".".join(parts[4:]).replace("nin_shortcut", "conv_shortcut")
        return f"down_blocks.{parts[1]}.resnets.{parts[3]}.{rest}"
    return f"down_blocks.{parts[1]}.downsamplers.0.{'.'.join(parts[3:])}"


def _infer_config(state: dict[str, Tensor]) -> dict[str, Any]:
    n_down = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("down_blocks."))
    widths = [state[f"down_blocks.{i}.resnets.0.conv2.weight"].shape[0] for i in range(n_down)]
    n_res = 1 + max(int(k.split(".")[3]) for k in state if k.startswith("down_blocks.0.resnets."))
    latent = state["conv_out.weight"].shape[0] // 2
    config = {
        **ENCODER_CONFIG,
        "in_channels": state["conv_in.weight"].shape[1],
        "latent_channels": latent,
        "block_out_channels": widths,
        "layers_per_block": n_res,
        "mid_block_add_attention": any(k.startswith("mid_block.attentions.") for k in state),
        "use_quant_conv": "quant_conv.weight" in state,
        "latent_bn": "bn.running_mean" in state,
    }
    if latent != 16:  # FLUX.1's factors are the defaults; others must come from the user
        config.update(scaling_factor=1.0, shift_factor=0.0)
    if config["latent_bn"]:
        config.update(batch_norm_eps=1e-4, scaling_factor=None, shift_factor=None)
    return config
