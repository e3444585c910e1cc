"""TAESD checkpoints: madebyollin's ``*_decoder.pth`` / safetensors and diffusers'
``AutoencoderTiny`` layouts -> our canonical names (read with ``weights_only=True``)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from app.families.taesd.decoder.model import DEFAULTS, Architecture

# --- checkpoint conversion -------------------------------------------------

_CANONICAL = re.compile(r"^(conv_in|mid|up|conv_out)\.")


def _load(source: Path) -> dict[str, Tensor]:
    if source.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(source))
    # weights_only: a .pth is a pickle; never run code from it.
    return torch.load(source, weights_only=True, map_location="cpu")


def _to_flat(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Upstream ``nn.Sequential`` indices (0 = Clamp), from any known layout.

    Layouts: madebyollin's ``N.*`` (.pth and safetensors), and diffusers'
    ``decoder.layers.N.*`` (AutoencoderTiny, taef2.safetensors) whose Sequential
    lacks the Clamp module, so its indices are one lower. Encoder keys are dropped.
    """
    if any(k.startswith("decoder.") for k in sd):
        sd = {k[len("decoder.") :]: v for k, v in sd.items() if k.startswith("decoder.")}
    if all(k.startswith("layers.") for k in sd):
        return {_shift(k[len("layers.") :]): v for k, v in sd.items()}
    if not all(k.split(".", 1)[0].isdigit() for k in sd):
        bad = next(k for k in sd if not k.split(".", 1)[0].isdigit())
        raise ValueError(f"taesd: not a tiny-decoder state dict (unexpected key {bad!r})")
    return sd


def _shift(key: str) -> str:
    index, rest = key.split(".", 1)
    return f"{int(index) + 1}.{rest}"


def _group(sd: dict[str, Tensor]) -> dict[int, dict[str, Tensor]]:
    groups: dict[int, dict[str, Tensor]] = {}
    for key, value in sd.items():
        index, rest = key.split(".", 1)
        groups.setdefault(int(index), {})[rest] = value
    return dict(sorted(groups.items()))


def _canonical_prefixes(groups: dict[int, dict[str, Tensor]]) -> dict[int, str]:
    """Walk the Sequential: conv_in, mid blocks, (upsample, conv, blocks)*, conv_out."""
    indices = list(groups)
    names: dict[int, str] = {}
    stage, block = -1, 0
    for pos, index in enumerate(indices):
        entry = groups[index]
        if pos == 0:
            names[index] = "conv_in"
        elif pos == len(indices) - 1:
            names[index] = "conv_out"
        elif "conv.0.weight" in entry:
            where = "mid" if stage < 0 else f"up.{stage}.blocks"
            names[index], block = f"{where}.{block}", block + 1
        elif set(entry) == {"weight"} and index - indices[pos - 1] == 2:
            stage, block = stage + 1, 0  # the gap is the parameter-free upsample
            names[index] = f"up.{stage}.conv"
        else:
            raise ValueError(f"taesd: unexpected layer {index} with {sorted(entry)}")
    return names


def _canonicalize(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    if all(_CANONICAL.match(k) for k in sd):
        return dict(sd)
    groups = _group(_to_flat(sd))
    first = next(iter(groups.values()), {}).get("weight")
    if first is not None and first.ndim == 4 and first.shape[1] == 3:  # a conv taking RGB
        raise ValueError(
            "taesd: an encoder's weights (its first conv takes RGB); import the decoder's "
            "file (*_decoder.pth) or the folder holding both"
        )
    prefixes = _canonical_prefixes(groups)
    return {f"{prefixes[i]}.{rest}": v for i, entry in groups.items() for rest, v in entry.items()}


def _count(sd: dict[str, Tensor], pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in sd if (m := rx.match(k))})


def infer_config(sd: dict[str, Tensor]) -> dict[str, Any]:
    """The config of a canonical state dict, read from its key names and shapes."""
    latent = int(sd["conv_in.weight"].shape[1])
    n_up = _count(sd, r"^up\.(\d+)\.conv\.weight$")
    channels = [int(sd["conv_in.weight"].shape[0])]
    channels += [int(sd[f"up.{i}.conv.weight"].shape[0]) for i in range(n_up)]
    blocks = [_count(sd, r"^mid\.(\d+)\.")]
    blocks += [_count(sd, rf"^up\.{i}\.blocks\.(\d+)\.") for i in range(n_up)]
    pool = sd.get("mid.0.pool.0.weight")
    if pool is not None:
        variant = "taef2"
    else:
        # Same architecture; the latent width tells the latent space (TAESD3 is 16 ch too).
        variant = "taef1" if latent == 16 else "taesd"
    return {
        "variant": variant,
        "latent_channels": latent,
        "channels": channels,
        "blocks": blocks,
        "mid_pool_channels": 0 if pool is None else int(pool.shape[0]),
        "mid_pool_groups": DEFAULTS["mid_pool_groups"],
    }


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``*_decoder.pth`` or ``.safetensors`` -> (config, state dict in canonical names).

    The variant comes from the weights (pool branch, latent width), never the file name.
    Tensors keep the checkpoint's dtype (the released ones are float16).
    """
    source = Path(source)
    if source.is_dir():
        source = _pick_file(source.iterdir())
    sd = _canonicalize(_load(source))
    config = infer_config(sd)
    Architecture(config).load_state_dict(sd, strict=True)  # fail at import, not at serve
    return config, sd


def _pick_file(files: Iterable[Path]) -> Path:
    found = sorted(
        p
        for p in files
        if p.name.endswith(("decoder.pth", ".safetensors")) and "encoder" not in p.name
    )
    if not found:
        raise FileNotFoundError("taesd: no *_decoder.pth or .safetensors in the folder")
    return found[0]
