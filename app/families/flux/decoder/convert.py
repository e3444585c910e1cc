"""Where FLUX-family weights come from: checkpoint layouts (seeded weights: ``synthetic.py``).

Our names are diffusers' decoder names minus the ``decoder.`` prefix (plus ``post_quant_conv``
and FLUX.2's ``bn.running_*``), so a diffusers folder converts by dropping a prefix; Black
Forest Labs' / LDM single files (``ae.safetensors``) by the name map below.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import Tensor

from app.families import ops
from app.families.flux.decoder.model import FLUX1_CONFIG

# BFL / LDM single-file names -> ours, for the parts that are not per up (or down) block;
# the encoder's convert reads its single files with these helpers too.
LDM_FIXED = {
    "conv_in": "conv_in",
    "mid.block_1": "mid_block.resnets.0",
    "mid.block_2": "mid_block.resnets.1",
    "mid.attn_1.norm": "mid_block.attentions.0.group_norm",
    "mid.attn_1.q": "mid_block.attentions.0.to_q",
    "mid.attn_1.k": "mid_block.attentions.0.to_k",
    "mid.attn_1.v": "mid_block.attentions.0.to_v",
    "mid.attn_1.proj_out": "mid_block.attentions.0.to_out.0",
    "norm_out": "conv_norm_out",
    "conv_out": "conv_out",
}
SINGLE_FILE_PREFIXES = ("first_stage_model.", "vae.", "ae.")


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A diffusers ``vae/`` folder (or pipeline folder) or a BFL/LDM single file -> ours."""
    source = Path(source)
    if source.is_dir():
        return _convert_diffusers_folder(source)
    return _convert_single_file(source)


def read_diffusers_folder(folder: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config.json, every tensor) of a diffusers ``vae/`` folder, or of the pipeline folder
    holding one."""
    if not (folder / "config.json").exists() and (folder / "vae" / "config.json").exists():
        folder = folder / "vae"
    return json.loads((folder / "config.json").read_text()), ops.read_safetensors_folder(folder)


def read_single_file(path: Path, half: str) -> dict[str, Tensor]:
    """Every tensor of a BFL/LDM single file, without the first of ``SINGLE_FILE_PREFIXES``
    that ``half`` (``"decoder."`` or ``"encoder."``) stands under."""
    with safe_open(str(path), framework="pt") as f:
        raw = {k: f.get_tensor(k) for k in f.keys()}
    for prefix in SINGLE_FILE_PREFIXES:
        if any(k.startswith(prefix + half) for k in raw):
            return {k.removeprefix(prefix): v for k, v in raw.items() if k.startswith(prefix)}
    return raw


def from_ldm(tensors: dict[str, Tensor], name_of: Callable[[str], str]) -> dict[str, Tensor]:
    """One half's LDM tensors (its prefix dropped) in our names: ``name_of`` maps each module
    path; the attention projections, 1x1 convs in BFL's files, become linear weights."""
    state: dict[str, Tensor] = {}
    for key, value in tensors.items():
        name, leaf = key.rsplit(".", 1)
        ours = name_of(name)
        if ours.startswith("mid_block.attentions.0.to_") and value.ndim == 4:
            value = value[:, :, 0, 0]  # BFL stores the attention projections as 1x1 convs
        state[f"{ours}.{leaf}"] = value.contiguous()
    return state


def fixed_ldm_name(name: str, fixed: dict[str, str]) -> str | None:
    """Our name for an LDM module path of the parts in ``fixed`` (or under one), else None."""
    if name in fixed:
        return fixed[name]
    for ldm, ours in fixed.items():
        if name.startswith(ldm + "."):
            return ours + name[len(ldm) :]
    return None


def _convert_diffusers_folder(folder: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    raw, state = read_diffusers_folder(folder)
    config = {key: raw[key] for key in FLUX1_CONFIG if key in raw}
    config["block_out_channels"] = (
        raw.get("decoder_block_out_channels") or raw["block_out_channels"]
    )
    config["use_post_quant_conv"] = "post_quant_conv.weight" in state
    config["latent_bn"] = "bn.running_mean" in state
    if config["latent_bn"]:
        config["batch_norm_eps"] = raw.get("batch_norm_eps", 1e-4)
    config["source_class"] = raw.get("_class_name", "AutoencoderKL")
    out = {}
    for key, value in state.items():
        if key.startswith("decoder."):
            out[key.removeprefix("decoder.")] = value
        elif key.startswith(("post_quant_conv.", "bn.running_")):
            out[key] = value
    return config, out


def _convert_single_file(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    raw = read_single_file(path, "decoder.")
    dec = {k.removeprefix("decoder."): v for k, v in raw.items() if k.startswith("decoder.")}
    if not dec:
        raise ValueError(f"{path}: no decoder.* tensors: not a FLUX/LDM autoencoder checkpoint")
    n_up = 1 + max(int(k.split(".")[1]) for k in dec if k.startswith("up."))
    state = from_ldm(dec, lambda name: _ldm_name(name, n_up))
    for key in ("post_quant_conv.weight", "post_quant_conv.bias"):
        if key in raw:
            state[key] = raw[key]
    if "bn.running_mean" in raw:
        state["bn.running_mean"] = raw["bn.running_mean"]
        state["bn.running_var"] = raw["bn.running_var"]
    return _infer_config(state, n_up), state


def _ldm_name(name: str, n_up: int) -> str:
    if (fixed := fixed_ldm_name(name, LDM_FIXED)) is not None:
        return fixed
    parts = name.split(".")  # up.{i}.block.{j}.rest | up.{i}.upsample.conv
    if parts[0] != "up":
        raise ValueError(f"unexpected decoder tensor {name!r}")
    block = n_up - 1 - int(parts[1])  # BFL's up indices run in reverse of diffusers'
    if parts[2] == "block":
        rest = ".".join(parts[4:]).replace("nin_shortcut", "conv_shortcut")
        return f"up_blocks.{block}.resnets.{parts[3]}.{rest}"
    return f"up_blocks.{block}.upsamplers.0.{'.'.join(parts[3:])}"


def _infer_config(state: dict[str, Tensor], n_up: int) -> dict[str, Any]:
    latent = state["conv_in.weight"].shape[1]
    widths = [state[f"up_blocks.{i}.resnets.0.conv2.weight"].shape[0] for i in range(n_up)]
    n_res = 1 + max(int(k.split(".")[3]) for k in state if k.startswith("up_blocks.0.resnets."))
    config = {
        **FLUX1_CONFIG,
        "latent_channels": latent,
        "block_out_channels": list(reversed(widths)),
        "layers_per_block": n_res - 1,
        "mid_block_add_attention": any(k.startswith("mid_block.attentions.") for k in state),
        "use_post_quant_conv": "post_quant_conv.weight" in state,
        "latent_bn": "bn.running_mean" in state,
    }
    if latent != 16:  # FLUX.1's factors are the defaults; others must come from the user
        config.update(scaling_factor=1.0, shift_factor=0.0)
    if config["latent_bn"]:
        config["batch_norm_eps"] = 1e-4
    return config
