"""TAESD encoder checkpoints -> our canonical names (read with ``weights_only=True``).

Layouts: madebyollin's ``*_encoder.pth`` / safetensors (a flat ``nn.Sequential``:
``N.*``), diffusers' ``AutoencoderTiny`` (``encoder.layers.N.*``, the same indices), and
our own names. The variant comes from the weights (pool branch, latent width).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from app.families.taesd.encoder.encode import Encoder
from app.families.taesd.encoder.model import DEFAULTS

_CANONICAL = re.compile(r"^(conv_in|down|conv_out)\.")


def _load(source: Path) -> dict[str, Tensor]:
    if source.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(source))
    return torch.load(source, weights_only=True, map_location="cpu")  # a pickle: no code


def _flat(sd: dict[str, Tensor]) -> dict[int, dict[str, Tensor]]:
    """Sequential index -> that layer's tensors, from madebyollin's or diffusers' layout."""
    if any(k.startswith("encoder.") for k in sd):
        sd = {k.removeprefix("encoder."): v for k, v in sd.items() if k.startswith("encoder.")}
    sd = {k.removeprefix("layers."): v for k, v in sd.items()}
    groups: dict[int, dict[str, Tensor]] = {}
    for key, value in sd.items():
        index, _, rest = key.partition(".")
        if not index.isdigit():
            raise ValueError(f"taesd: not a tiny-encoder state dict (unexpected key {key!r})")
        groups.setdefault(int(index), {})[rest] = value
    return dict(sorted(groups.items()))


def _canonicalize(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Walk the Sequential: conv_in, blocks, (stride-2 conv, blocks)*, conv_out."""
    if all(_CANONICAL.match(k) for k in sd):
        return dict(sd)
    groups = _flat(sd)
    if not groups:
        raise ValueError("taesd: no encoder tensors (a decoder-only checkpoint?)")
    indices = list(groups)
    out: dict[str, Tensor] = {}
    stage, block = 0, 0
    for pos, index in enumerate(indices):
        entry = groups[index]
        if pos == 0:
            prefix = "conv_in"
        elif pos == len(indices) - 1:
            prefix = "conv_out"
        elif "conv.0.weight" in entry:
            prefix, block = f"down.{stage}.blocks.{block}", block + 1
        elif set(entry) == {"weight"}:
            stage, block = stage + 1, 0  # the bias-free convs are the stride-2 downsamplers
            prefix = f"down.{stage}.conv"
        else:
            raise ValueError(f"taesd: unexpected encoder layer {index} with {sorted(entry)}")
        out.update({f"{prefix}.{rest}": v for rest, v in entry.items()})
    return out


def _count(sd: dict[str, Tensor], pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in sd if (m := rx.match(k))})


def infer_config(sd: dict[str, Tensor]) -> dict[str, Any]:
    """The config of a canonical state dict, read from its key names and shapes."""
    latent = int(sd["conv_out.weight"].shape[0])
    n_stages = _count(sd, r"^down\.(\d+)\.")
    channels = [int(sd["conv_in.weight"].shape[0])]
    channels += [int(sd[f"down.{i}.conv.weight"].shape[0]) for i in range(1, n_stages)]
    blocks = [_count(sd, rf"^down\.{i}\.blocks\.(\d+)\.") for i in range(n_stages)]
    pools = []
    for i in range(n_stages):
        pool = sd.get(f"down.{i}.blocks.0.pool.0.weight")
        pools.append(0 if pool is None else int(pool.shape[0]))
    variant = "taef2" if any(pools) else ("taef1" if latent == 16 else "taesd")
    return {
        "variant": variant,
        "latent_channels": latent,
        "channels": channels,
        "blocks": blocks,
        "pool_channels": pools,
        "pool_groups": DEFAULTS["pool_groups"],  # not visible in the shapes; upstream's 4
    }


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``*_encoder.pth`` / ``.safetensors`` (or a folder holding one) -> (config, state).
    Tensors keep the checkpoint's dtype (the released ones are float16)."""
    source = Path(source)
    if source.is_dir():
        found = sorted(
            p for p in source.iterdir() if p.name.endswith(("encoder.pth", ".safetensors"))
        )
        if not found:
            raise FileNotFoundError(f"taesd: no *_encoder.pth or .safetensors in {source}")
        source = found[0]
    sd = _canonicalize(_load(source))
    if sd["conv_in.weight"].shape[1] != 3:  # a decoder's first conv reads the latent
        raise ValueError(
            f"{source}: not a tiny encoder (its first conv reads "
            f"{sd['conv_in.weight'].shape[1]} channels, not RGB): a decoder?"
        )
    config = infer_config(sd)
    Encoder(config).load_state_dict(sd, strict=True)  # fail at import, not at serve
    return config, sd
