"""Where LTX encoder weights come from:
  * a diffusers ``vae/`` folder (``AutoencoderKLLTXVideo`` or ``AutoencoderKLLTX2Video``): its
    config's encoder keys are kept; an LTX-2 one gets ``"version": "ltx2"``;
  * a Lightricks single file (``ltx-video-2b-v0.9*.safetensors``, LTX-2 checkpoints): its
    ``vae.encoder.*`` tensors, a flat ``down_blocks`` list of resnet groups
    (``res_blocks``), downsamplers and (0.9.0) lone channel-changing resnets, the last
    resnet group being the mid block. The config is inferred from the shapes: lone resnets or
    only stride-2 convs make ``LTXVideoDownBlock3D`` blocks, space-to-depth downsamplers
    ``LTXVideo095DownBlock3D`` ones (the kind told by the channel factor: 2 temporal,
    4 spatial, 8 both); the arithmetic of an LTX-2 encoder is that of such a 0.9.5 layout.
    The embedded config's ``encoder_spatial_padding_mode`` / ``spatial_padding_mode`` and
    ``encoder_causal`` / ``causal`` are read when present.
Anything that does not fit the encoder exactly is refused, named."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import Tensor

from app.families import encoding
from app.families.ltx.encoder.encode import DEFAULTS, LTX2_DEFAULTS, VERSION_LTX2, Encoder

EXTRA_KEYS = ("spatial_compression_ratio", "temporal_compression_ratio")
STATS = ("per_channel_statistics.mean-of-means", "per_channel_statistics.std-of-means")
KIND_BY_FACTOR = {2: "temporal", 4: "spatial", 8: "spatiotemporal"}


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    source = Path(source)
    if source.is_dir():
        config, state = _from_folder(source)
    else:
        config, state = _from_single_file(source)
    encoding.check_state(Encoder, config, state, source)
    return config, state


def _from_folder(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    raw, tensors = encoding.read_vae_folder(source)
    ltx2 = "LTX2" in str(raw.get("_class_name", ""))
    base = LTX2_DEFAULTS if ltx2 else DEFAULTS
    config = {k: raw.get(k, v) for k, v in base.items()}
    if ltx2:
        config["version"] = VERSION_LTX2
    config.update({k: raw[k] for k in EXTRA_KEYS if raw.get(k)})
    _add_stats(config, tensors.get("latents_mean"), tensors.get("latents_std"))
    return encoding.jsonable(config), encoding.encoder_state(tensors)


def _add_stats(config: dict[str, Any], mean: Tensor | None, std: Tensor | None) -> None:
    if mean is not None and std is not None:
        config["latents_mean"] = mean.float().flatten().tolist()
        config["latents_std"] = std.float().flatten().tolist()


# --- Lightricks single files ------------------------------------------------------------------
_ENTRY = re.compile(r"^encoder\.down_blocks\.(\d+)\.(.+)$")


def _from_single_file(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = json.loads((f.metadata() or {}).get("config", "{}") or "{}")
        keys = [
            k for k in f.keys() if k.startswith(("vae.encoder.", "vae.per_channel", "encoder."))
        ]
        tensors = {k.removeprefix("vae."): f.get_tensor(k) for k in keys}
    if "encoder.conv_in.conv.weight" not in tensors:
        raise ValueError(f"{path}: no LTX encoder tensors (vae.encoder.*): a decoder-only file?")
    raw = meta.get("vae", meta)
    if "encoder.mid_block.resnets.0.conv1.conv.weight" in tensors:  # already diffusers' names
        return _jsonable_config(_infer_diffusers_named(tensors, raw), tensors), _encoder(tensors)
    entries = _entries(tensors, path)
    state = _renamed(tensors, entries)
    config = _infer_config(state, entries, raw, path)
    return _jsonable_config(config, tensors), state


def _jsonable_config(config: dict[str, Any], tensors: dict[str, Tensor]) -> dict[str, Any]:
    _add_stats(config, tensors.get(STATS[0]), tensors.get(STATS[1]))
    return encoding.jsonable(config)


def _encoder(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v for k, v in tensors.items() if k.startswith("encoder.")}


def _entries(tensors: dict[str, Tensor], path: Path) -> list[tuple[int, str]]:
    """The original list in order, each entry a ``res`` group, a ``down`` sampler or a lone
    ``resnet`` (0.9.0's channel-changing block)."""
    kinds: dict[int, str] = {}
    for key in tensors:
        if m := _ENTRY.match(key):
            n, rest = int(m.group(1)), m.group(2)
            kind = "res" if rest.startswith("res_blocks.") else "resnet"
            if rest.startswith("conv."):
                kind = "down"
            kinds[n] = kind
    if not kinds or kinds[max(kinds)] != "res":
        raise ValueError(f"{path}: the LTX encoder list does not end in a resnet group (its mid)")
    return sorted(kinds.items())


def _targets(entries: list[tuple[int, str]]) -> dict[int, str]:
    """Original entry -> diffusers prefix: a resnet group opens a block (the last one is the
    mid block), a downsampler closes one, a lone resnet is its ``conv_out``."""
    targets, block, filled = {}, -1, {"res", "down", "resnet"}
    last = entries[-1][0]
    for n, kind in entries:
        if kind == "res" and n == last:
            targets[n] = "encoder.mid_block."
            continue
        if (
            block < 0
            or (kind == "res" and filled)
            or (kind == "down" and filled & {"down", "resnet"})
        ):
            block, filled = block + 1, set()
        filled.add(kind)
        suffix = {"res": "", "down": "downsamplers.0.", "resnet": "conv_out."}[kind]
        targets[n] = f"encoder.down_blocks.{block}.{suffix}"
    return targets


def _renamed(tensors: dict[str, Tensor], entries: list[tuple[int, str]]) -> dict[str, Tensor]:
    targets = _targets(entries)
    state = {}
    for key, value in _encoder(tensors).items():
        if m := _ENTRY.match(key):
            key = targets[int(m.group(1))] + m.group(2).replace("res_blocks.", "resnets.")
        key = key.replace("norm3.norm.", "norm3.")
        if ".conv_shortcut." in key and ".conv_shortcut.conv." not in key:
            key = key.replace(".conv_shortcut.", ".conv_shortcut.conv.")
        state[key] = value
    return state


def _width(state: dict[str, Tensor], prefix: str) -> int:
    return state[prefix + "resnets.0.conv1.conv.weight"].shape[0]


def _count(state: dict[str, Tensor], prefix: str) -> int:
    return len({k[len(prefix) :].split(".")[1] for k in state if k.startswith(prefix + "resnets.")})


def _infer_config(
    state: dict[str, Tensor], entries: list[tuple[int, str]], raw: dict[str, Any], path: Path
) -> dict[str, Any]:
    """The diffusers config that builds exactly these weights."""
    blocks = sorted({int(k.split(".")[2]) for k in state if k.startswith("encoder.down_blocks.")})
    pre = [f"encoder.down_blocks.{i}." for i in blocks]
    stem = state["encoder.conv_in.conv.weight"].shape[0]
    mid = _width(state, "encoder.mid_block.")
    widths = [_width(state, p) if _count(state, p) else None for p in pre]
    old = any(kind == "resnet" for _, kind in entries) or not any(
        p + "downsamplers.0.conv.conv.weight" in state for p in pre
    )
    downs = [p + "downsamplers.0.conv.weight" in state or p + "downsamplers.0.conv.conv.weight"
             in state for p in pre]  # fmt: skip
    layers = [_count(state, p) for p in pre] + [_count(state, "encoder.mid_block.")]
    cin = state["encoder.conv_in.conv.weight"].shape[1]
    patch = math.isqrt(cin // 3)
    config: dict[str, Any] = {
        **DEFAULTS,
        "in_channels": 3,
        "latent_channels": state["encoder.conv_out.conv.weight"].shape[0] - 1,
        "layers_per_block": layers,
        "spatio_temporal_scaling": downs,
        "patch_size": patch,
        "encoder_causal": bool(raw.get("encoder_causal", raw.get("causal", True))),
    }
    mode = raw.get("encoder_spatial_padding_mode", raw.get("spatial_padding_mode"))
    if mode and mode != "zeros":
        config["encoder_spatial_padding_mode"] = mode
    if old:
        chans = [w if w is not None else stem for w in widths]
        config.update(block_out_channels=chans, down_block_types=["LTXVideoDownBlock3D"] * len(pre))
        config["downsample_type"] = ["conv"] * len(pre)
    else:
        outs = [w for w in widths[1:]] + [mid]
        chans, kinds = [stem], []
        for p, out, down in zip(pre, outs, downs, strict=True):
            out = out if out is not None else chans[-1]
            chans.append(out)
            kinds.append(_kind(state, p, out) if down else "conv")
        config.update(
            block_out_channels=chans,
            down_block_types=["LTXVideo095DownBlock3D"] * len(pre),
            downsample_type=kinds,
        )
    if cin != 3 * patch * patch:
        raise ValueError(f"{path}: conv_in takes {cin} channels: not 3 x patch^2")
    return config


def _kind(state: dict[str, Tensor], prefix: str, out: int) -> str:
    """A downsampler's kind: a stride-2 conv, or space-to-depth by the channel factor."""
    if prefix + "downsamplers.0.conv.weight" in state:
        return "conv"
    width = state[prefix + "downsamplers.0.conv.conv.weight"].shape[0]
    kind = KIND_BY_FACTOR.get(out // width)
    if kind is None or out % width:
        raise ValueError(f"{prefix}downsamplers.0: {width} channels to {out}: no LTX factor")
    return kind


def _infer_diffusers_named(tensors: dict[str, Tensor], raw: dict[str, Any]) -> dict[str, Any]:
    """A single file already in diffusers' names needs the config beside it in its metadata."""
    if not raw.get("block_out_channels"):
        raise ValueError("an LTX single file in diffusers' names without its embedded config")
    base = LTX2_DEFAULTS if raw.get("version") == VERSION_LTX2 else DEFAULTS
    return {k: raw.get(k, v) for k, v in base.items()}
