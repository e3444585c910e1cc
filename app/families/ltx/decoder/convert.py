"""Where LTX-Video weights come from: a diffusers ``vae/`` folder (or a pipeline folder), a
Lightricks single-file checkpoint, or seeded synthetic weights (``ltx-tiny``, ``ltx2-tiny``).

LTX-2 (``AutoencoderKLLTX2Video``) arrives the same ways and is told apart by its config and
weights (``_ltx2_markers``); its config gets ``"version": "ltx2"`` (``ltx2.variant_spec``).
A full LTX-2 checkpoint also holds the transformer, the audio VAE and the vocoder: only the
video decoder is imported. Refused, naming what was seen: audio VAE / vocoder alone, LTX-2
single files without their embedded config or with blocks whose Lightricks and diffusers
arithmetic differ (``res_x_y``: GroupNorm vs LayerNorm), attention blocks, the diffusion
decoder, and anything whose weights do not fit the config exactly."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from app.families import ops
from app.families.checkpoint import state_mismatch
from app.families.ltx.decoder import ltx2
from app.families.ltx.decoder.ltx2 import variant_spec
from app.families.ltx.decoder.model import DEFAULT_FPS, DEFAULTS, Architecture


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A diffusers ``vae/`` folder (or a pipeline folder holding one), or a Lightricks
    single-file checkpoint -> (config, decoder-only state dict in canonical names)."""
    source = Path(source)
    if source.is_dir():
        folder = source / "vae" if (source / "vae" / "config.json").exists() else source
        raw = json.loads((folder / "config.json").read_text())
        _refuse_audio_class(source, raw)
        tensors = ops.read_safetensors_folder(folder)
        seen = _ltx2_markers(raw, tensors, folder=True)
        if seen and raw.get("_class_name") != "AutoencoderKLLTX2Video":
            raise ValueError(
                f"{source}: LTX-2 marks ({'; '.join(seen)}) without _class_name "
                "'AutoencoderKLLTX2Video': which decoder arithmetic it needs is unknown"
            )
        config, state = (_ltx2_from_diffusers if seen else _from_diffusers)(tensors, raw)
    else:
        raw, tensors = _read_single_file(source)
        with safe_open(str(source), framework="pt", device="cpu") as f:
            seen = _ltx2_markers(raw, f.keys(), folder=False)
        if seen:
            config, state = _ltx2_from_lightricks(source, tensors, raw, seen)
        elif any(".res_blocks." in k or "per_channel_statistics" in k for k in tensors):
            config, state = _from_lightricks(tensors, raw)
        else:
            config, state = _from_diffusers(tensors, raw)
    _check_state(config, state)
    return config, state


# LTX-2 (``AutoencoderKLLTX2Video``) shares LTX-Video's key names but not its arithmetic
# (reflect spatial padding, spatial-only / temporal-only upsamplers, plain conv shortcuts):
# decoded as 0.9.x it comes out wrong without a word, so it is told apart by what gives it away.
_LTX2_CONFIG_KEYS = ("upsample_type", "encoder_spatial_padding_mode")
_LTX2_PADDING_KEYS = ("decoder_spatial_padding_mode", "spatial_padding_mode")
_LTX2_KEY_MARKERS = ("audio_vae.", "vocoder.", "model.diffusion_model.audio_")
_AUDIO_CLASSES = ("Audio", "Vocoder")


def _ltx2_markers(raw: dict[str, Any], keys: Any, folder: bool) -> list[str]:
    """What marks a checkpoint as LTX-2 (empty: LTX-Video 0.9.x)."""
    seen = []
    if "LTX2" in str(raw.get("_class_name", "")):
        seen.append(f"_class_name {raw['_class_name']!r}")
    seen += [f"config key {k!r}" for k in _LTX2_CONFIG_KEYS if k in raw]
    seen += [f"{k}={raw[k]!r}" for k in _LTX2_PADDING_KEYS if raw.get(k, "zeros") != "zeros"]
    blocks = raw.get("decoder_blocks") or raw.get("blocks") or []
    seen += sorted(
        {f"decoder block {b[0]!r}" for b in blocks if b[0] in ("compress_space", "compress_time")}
    )
    marked = sorted({m for k in keys for m in _LTX2_KEY_MARKERS if k.startswith(m)})
    seen += [f"tensors under {m!r}" for m in marked]
    if folder and any(k.endswith("conv_shortcut.weight") for k in keys):
        seen.append("plain conv_shortcut weights (0.9.x diffusers has conv_shortcut.conv)")
    return seen


def _refuse_audio_class(source: Path, raw: dict[str, Any]) -> None:
    name = str(raw.get("_class_name", ""))
    if any(a in name for a in _AUDIO_CLASSES):
        raise ValueError(
            f"{source}: _class_name {name!r} is LTX-2's audio side (audio VAE / vocoder); "
            "the ltx family decodes video only (import the pipeline's vae/ folder)"
        )


def _read_single_file(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Tensors of a safetensors file (VAE ones only) and its embedded JSON config, if any."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = json.loads((f.metadata() or {}).get("config", "{}") or "{}")
        keys = [k for k in f.keys() if k.startswith(("vae.", "decoder.", "per_channel"))]
        audio = sorted({m for k in f.keys() for m in _LTX2_KEY_MARKERS[:2] if k.startswith(m)})
        tensors = {k: f.get_tensor(k) for k in keys}
    if not tensors and audio:
        raise ValueError(
            f"{path}: only LTX-2 audio parts (tensors under {', '.join(map(repr, audio))}), "
            "no video VAE: the ltx family decodes video only"
        )
    if not tensors:
        raise ValueError(f"{path}: no LTX VAE tensors (expected vae.decoder.* or decoder.*)")
    return meta.get("vae", meta), tensors


def _from_diffusers(tensors: dict[str, Tensor], raw: dict[str, Any]) -> tuple[dict, dict]:
    config = {k: raw.get(k, v) for k, v in DEFAULTS.items()}
    state = {k[len("decoder.") :]: v for k, v in tensors.items() if k.startswith("decoder.")}
    _add_stats(config, tensors.get("latents_mean"), tensors.get("latents_std"))
    config["fps"] = DEFAULT_FPS
    return _jsonable(config), state


def _add_stats(config: dict[str, Any], mean: Tensor | None, std: Tensor | None) -> None:
    if mean is not None and std is not None:
        config["latents_mean"] = mean.float().flatten().tolist()
        config["latents_std"] = std.float().flatten().tolist()


def _jsonable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


def _ltx2_from_diffusers(tensors: dict[str, Tensor], raw: dict[str, Any]) -> tuple[dict, dict]:
    """An ``AutoencoderKLLTX2Video`` folder: its config's decoder keys, ``version`` ltx2."""
    config = {k: raw.get(k, v) for k, v in ltx2.DEFAULTS.items()}
    config["version"] = ltx2.VERSION
    state = {k[len("decoder.") :]: v for k, v in tensors.items() if k.startswith("decoder.")}
    _add_stats(config, tensors.get("latents_mean"), tensors.get("latents_std"))
    config["fps"] = DEFAULT_FPS
    return _jsonable(ltx2.normalize_config(config)), state


_LTX2_COMPRESS = {
    "compress_all": "spatiotemporal",
    "compress_space": "spatial",
    "compress_time": "temporal",
}
_LTX2_REFUSED_BLOCKS = {
    "res_x_y": "its norm3 is GroupNorm(1 group) in Lightricks' code, LayerNorm in diffusers'",
    "attn_res_x": "attention resnets",
    "attn": "attention blocks",
}


def _ltx2_from_lightricks(
    source: Path, tensors: dict[str, Tensor], raw: dict[str, Any], seen: list[str]
) -> tuple[dict, dict]:
    """An LTX-2 single file (``ltx-2-*.safetensors``, or its VAE alone): the video decoder
    from ``vae.decoder.*`` and its embedded ``config.vae`` (audio VAE, vocoder and the
    transformer are ignored)."""
    why = f"{source}: an LTX-2 single file ({'; '.join(seen)})"
    kind = raw.get("_class_name", "CausalVideoAutoencoder")
    if kind != "CausalVideoAutoencoder":
        raise ValueError(f"{why} with a {kind!r} VAE, not the conv decoder the ltx family has")
    if not raw.get("decoder_blocks"):
        raise ValueError(
            f"{why} without its embedded config (decoder_blocks): upsampler residuals, "
            "padding and causality are not in the weights"
        )
    if raw.get("norm_layer", "pixel_norm") != "pixel_norm" or raw.get("dims", 3) != 3:
        raise ValueError(f"{why}: norm_layer {raw.get('norm_layer')!r} / dims {raw.get('dims')}")
    order = [_ltx2_block(b) for b in reversed(raw["decoder_blocks"])]  # decode order
    unknown = sorted({n for n, _ in order if n != "res_x" and n not in _LTX2_COMPRESS})
    if unknown:
        reasons = [f"{n!r} ({_LTX2_REFUSED_BLOCKS.get(n, 'unknown')})" for n in unknown]
        raise ValueError(f"{why}: decoder blocks not decoded exactly: {', '.join(reasons)}")
    ups, pending = [], None
    for name, params in order[1:]:
        if name == "res_x":
            ups.append((pending, params))
            pending = None
        elif pending is not None:
            raise ValueError(f"{why}: two upsamplers in a row in decoder_blocks")
        else:
            pending = (name, params)
    if order[0][0] != "res_x" or pending is not None:
        raise ValueError(f"{why}: decoder_blocks must run res_x, ([compress_*] res_x)...")
    prefix = "vae." if any(k.startswith("vae.") for k in tensors) else ""
    dec = {k[len(prefix) + 8 :]: v for k, v in tensors.items() if k.startswith(prefix + "decoder.")}
    kinds = _original_blocks(dec)
    expected = ["compress" if n in _LTX2_COMPRESS else n for n, _ in order]
    if kinds != expected:
        raise ValueError(f"{why}: its weights hold blocks {kinds}, its config {expected}")
    targets = _block_targets(kinds)
    state = {_rename_original(k, targets): v for k, v in dec.items()}
    mid = order[0][1]
    factors = [int(c[1].get("multiplier", 1)) if c else 1 for c, _ in ups]
    couts = [state[f"up_blocks.{i}.resnets.0.conv1.conv.weight"].shape[0] for i in range(len(ups))]
    rev = {
        "decoder_block_out_channels": [c * f for c, f in zip(couts, factors, strict=True)],
        "decoder_layers_per_block": [mid["num_layers"]] + [p["num_layers"] for _, p in ups],
        "decoder_spatio_temporal_scaling": [c is not None for c, _ in ups],
        "decoder_inject_noise": [
            bool(p.get("inject_noise", False)) for p in [mid] + [p for _, p in ups]
        ],
        "upsample_residual": [
            bool(c and c[0] == "compress_all" and c[1].get("residual", False)) for c, _ in ups
        ],
        "upsample_factor": factors,
    }
    out = state["conv_out.conv.weight"].shape[0]
    patch = int(raw.get("patch_size") or 4)
    padding = raw.get("spatial_padding_mode", raw.get("decoder_spatial_padding_mode", "reflect"))
    stats = {k.rsplit(".", 1)[-1]: v for k, v in tensors.items() if "per_channel_statistics" in k}
    config = {
        **ltx2.DEFAULTS,
        **{k: list(reversed(v)) for k, v in rev.items()},
        # diffusers indexes upsample_type in decode order (every other list: encoder order)
        "upsample_type": [_LTX2_COMPRESS[c[0]] if c else "spatiotemporal" for c, _ in ups],
        "latent_channels": state["conv_in.conv.weight"].shape[1],
        "out_channels": out // patch**2,
        "timestep_conditioning": "scale_shift_table" in state,
        "patch_size": patch,
        "patch_size_t": 1,
        "decoder_causal": bool(raw.get("causal_decoder", False)),
        "decoder_spatial_padding_mode": padding,
        "scaling_factor": float(raw.get("scaling_factor", 1.0)),
        "fps": DEFAULT_FPS,
    }
    _add_stats(config, stats.get("mean-of-means"), stats.get("std-of-means"))
    return _jsonable(config), state


def _ltx2_block(block: Any) -> tuple[str, dict[str, Any]]:
    """One ``decoder_blocks`` entry -> (kind, params); an int param is ``num_layers``."""
    if not isinstance(block, (list, tuple)) or not block:
        return "?", {}
    params = block[1] if len(block) > 1 else {}
    params = {"num_layers": params} if isinstance(params, int) else dict(params)
    return str(block[0]), params


# Lightricks' decoder is a flat list ``up_blocks.N`` of three kinds (in decode order):
#   res_x (``res_blocks.M``): resnets; res_x_y (``conv1`` directly): a channel-changing
#   resnet; compress_all (``conv.conv``): an upsampler. The first res_x is diffusers'
#   mid_block; every later res_x closes one diffusers up block [conv_in][upsampler] resnets.
_ORIG_BLOCK = re.compile(r"^up_blocks\.(\d+)\.(.+)$")


def _from_lightricks(tensors: dict[str, Tensor], raw: dict[str, Any]) -> tuple[dict, dict]:
    prefix = "vae." if any(k.startswith("vae.") for k in tensors) else ""
    dec = {k[len(prefix) + 8 :]: v for k, v in tensors.items() if k.startswith(prefix + "decoder.")}
    stats = {k.rsplit(".", 1)[-1]: v for k, v in tensors.items() if "per_channel_statistics" in k}
    kinds = _original_blocks(dec)
    targets = _block_targets(kinds)
    state: dict[str, Tensor] = {}
    for key, value in dec.items():
        state[_rename_original(key, targets)] = value
    config = _infer_config(state, raw)
    _add_stats(config, stats.get("mean-of-means"), stats.get("std-of-means"))
    return _jsonable(config), state


def _original_blocks(dec: dict[str, Tensor]) -> list[str]:
    """The kind of each original ``up_blocks.N``, in order."""
    kinds: dict[int, set[str]] = {}
    for key in dec:
        if m := _ORIG_BLOCK.match(key):
            rest = m.group(2)
            if rest.startswith(("res_blocks.", "time_embedder.")):
                kind = "res_x"
            else:
                kind = "compress" if rest.startswith("conv.") else "res_x_y"
            kinds.setdefault(int(m.group(1)), set()).add(kind)
    if sorted(kinds) != list(range(len(kinds))) or any(len(k) != 1 for k in kinds.values()):
        raise ValueError("Lightricks decoder: up_blocks.N are not a list of known block kinds")
    return [kinds[i].pop() for i in range(len(kinds))]


def _block_targets(kinds: list[str]) -> list[str]:
    """Original block index -> diffusers module path."""
    if not kinds or kinds[0] != "res_x":
        raise ValueError("Lightricks decoder: expected up_blocks.0 to be the mid res_x block")
    targets, block = ["mid_block"], 0
    names = {"res_x_y": "conv_in", "compress": "upsamplers.0"}
    for kind in kinds[1:]:
        if kind == "res_x":
            targets.append(f"up_blocks.{block}")
            block += 1
        else:
            targets.append(f"up_blocks.{block}.{names[kind]}")
    return targets


_ORIG_TOP = {"last_time_embedder.": "time_embedder.", "last_scale_shift_table": "scale_shift_table"}


def _rename_original(key: str, targets: list[str]) -> str:
    m = _ORIG_BLOCK.match(key)
    if m:
        key = f"{targets[int(m.group(1))]}.{m.group(2)}"
    for old, new in _ORIG_TOP.items():
        if key.startswith(old):
            key = new + key[len(old) :]
    key = key.replace("res_blocks.", "resnets.").replace("norm3.norm.", "norm3.")
    return re.sub(r"conv_shortcut\.(weight|bias)$", r"conv_shortcut.conv.\1", key)


def _infer_config(state: dict[str, Tensor], raw: dict[str, Any]) -> dict:
    """Decoder config from weight shapes; what weights cannot tell (upsampler residual,
    causality) from the checkpoint's embedded config, else as every release has it."""
    resnets = _count(state, r"^mid_block\.resnets\.(\d+)\.")
    blocks = _infer_blocks(state)
    uppers = [b for b in blocks if b["upsample"]]
    for b, residual in zip(uppers, _compress_residual(raw, len(uppers)), strict=True):
        b["residual"] = residual if residual is not None else b["factor"] > 1
    out = state["conv_out.conv.weight"].shape[0]
    patch = int(raw.get("patch_size") or round(math.sqrt(out / 3)))
    rev = {
        "decoder_block_out_channels": [b["cout"] * b["factor"] for b in blocks],
        "decoder_layers_per_block": [resnets] + [b["layers"] for b in blocks],
        "decoder_spatio_temporal_scaling": [b["upsample"] for b in blocks],
        "decoder_inject_noise": [_has_noise(state, "mid_block")] + [b["noise"] for b in blocks],
        "upsample_residual": [b.get("residual", False) for b in blocks],
        "upsample_factor": [b["factor"] for b in blocks],
    }
    config = {k: list(reversed(v)) for k, v in rev.items()}
    return {
        **DEFAULTS,
        **config,
        "latent_channels": state["conv_in.conv.weight"].shape[1],
        "out_channels": out // patch**2,
        "timestep_conditioning": "scale_shift_table" in state,
        "patch_size": patch,
        "decoder_causal": bool(raw.get("causal_decoder", False)),
        "scaling_factor": float(raw.get("scaling_factor", 1.0)),
        "fps": DEFAULT_FPS,
    }


def _infer_blocks(state: dict[str, Tensor]) -> list[dict[str, Any]]:
    blocks, i = [], 0
    while any(k.startswith(f"up_blocks.{i}.") for k in state):
        p = f"up_blocks.{i}"
        cout = state[f"{p}.resnets.0.conv1.conv.weight"].shape[0]
        up = state.get(f"{p}.upsamplers.0.conv.conv.weight")
        factor = up.shape[1] * 8 // up.shape[0] if up is not None else 1
        blocks.append(
            {
                "cout": cout,
                "layers": _count(state, rf"^{p}\.resnets\.(\d+)\."),
                "upsample": up is not None,
                "factor": factor,
                "noise": _has_noise(state, p),
            }
        )
        i += 1
    return blocks


def _compress_residual(raw: dict[str, Any], n: int) -> list[bool | None]:
    """``residual`` of each compress block in decode order, from Lightricks'
    ``decoder_blocks`` config (listed encoder-side first); None where unknown."""
    entries = []
    for block in reversed(raw.get("decoder_blocks") or raw.get("blocks") or []):
        params = block[1] if len(block) > 1 and isinstance(block[1], dict) else {}
        if str(block[0]).startswith("compress"):
            entries.append(params.get("residual"))
    return entries if len(entries) == n else [None] * n


def _count(state: dict[str, Tensor], pattern: str) -> int:
    rx = re.compile(pattern)
    found = {int(m.group(1)) for k in state if (m := rx.match(k))}
    return max(found) + 1 if found else 0


def _has_noise(state: dict[str, Tensor], prefix: str) -> bool:
    return any(k.startswith(prefix + ".") and "per_channel_scale1" in k for k in state)


def _check_state(config: dict[str, Any], state: dict[str, Tensor]) -> None:
    """The converted names and shapes must be exactly the decoder's (checked on meta)."""
    with torch.device("meta"):
        decoder = Architecture(*variant_spec(config))
    if problem := state_mismatch(decoder, state):
        raise ValueError(f"LTX checkpoint does not fit the inferred decoder config: {problem}")
