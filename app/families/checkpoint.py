"""What the families' ``convert.py`` share (the encoders' converts too): a single file's
tensors, the decoder half of a VAE checkpoint in canonical names, and a converted state dict
checked against the module it must load into."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn


def read_tensors(path: Path) -> dict[str, Tensor]:
    """Tensors of a safetensors file, or of a pickled ``.pth`` / ``.pt`` / ``.ckpt`` read with
    ``weights_only=True`` (no code runs; a ``state_dict`` entry is unwrapped)."""
    if path.suffix in (".pth", ".pt", ".ckpt"):
        loaded = torch.load(str(path), map_location="cpu", weights_only=True)
        loaded = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else loaded
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a pickle of {type(loaded).__name__}, not a state dict")
        return {k: v for k, v in loaded.items() if isinstance(v, Tensor)}
    return load_file(str(path))


def decoder_part(tensors: dict[str, Tensor], where: Path, vae: str) -> dict[str, Tensor]:
    """The decoder's tensors in canonical names (``decoder.`` dropped, ``post_quant_conv.*``
    kept); the encoder's are dropped, any other key refused, named (``vae``: whose)."""
    state, unknown = {}, []
    for key, value in tensors.items():
        if key.startswith("decoder."):
            state[key[len("decoder.") :]] = value
        elif key.startswith("post_quant_conv."):
            state[key] = value
        elif not key.startswith(("encoder.", "quant_conv.")):
            unknown.append(key)
    if unknown:
        raise ValueError(f"{where}: keys of no {vae} VAE part: {sorted(unknown)[:5]}")
    return state


def state_mismatch(module: nn.Module, state: dict[str, Tensor]) -> str | None:
    """What keeps ``state`` from loading into ``module`` exactly (up to five each of the
    missing, unexpected and misshaped names), or None when it fits."""
    expected = {k: v.shape for k, v in module.state_dict().items()}
    got = {k: v.shape for k, v in state.items()}
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    bad = sorted(k for k in expected.keys() & got.keys() if expected[k] != got[k])
    if missing or extra or bad:
        return f"missing {missing[:5]}, unexpected {extra[:5]}, wrong shape {bad[:5]}"
    return None
