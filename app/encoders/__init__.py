"""Encoder families, loaded by name: one package each, behind ``base.VAEEncoder``. The keys are
the decoder families' (``app.decoders.FAMILIES``); a family without an encoder is absent."""

from __future__ import annotations

import importlib
from types import ModuleType

ENCODERS: dict[str, str] = {
    "flux": "app.encoders.flux",
    "taesd": "app.encoders.taesd",
    "ltx": "app.encoders.ltx",
    "wan": "app.encoders.wan",
    "hunyuan-video": "app.encoders.hunyuan_video",
    "minimax-h3": "app.encoders.minimax_h3",
}


def encoder_module(family: str) -> ModuleType:
    """The encoder module of one family; ``KeyError`` names the families that have one."""
    if family not in ENCODERS:
        raise KeyError(f"no encoder for family {family!r}; encoders: {', '.join(ENCODERS)}")
    return importlib.import_module(ENCODERS[family])
