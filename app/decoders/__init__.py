"""Decoder families, loaded by name: one package each (docs/decoders.md), behind ``base.VAEDecoder``."""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES: dict[str, str] = {
    "flux": "app.decoders.flux",
    "hunyuan-video": "app.decoders.hunyuan_video",
    "ltx": "app.decoders.ltx",
    "minimax-h3": "app.decoders.minimax_h3",
    "taesd": "app.decoders.taesd",
    "wan": "app.decoders.wan",
}


def family_module(family: str) -> ModuleType:
    """The module of one family; ``KeyError`` names the known ones."""
    if family not in FAMILIES:
        raise KeyError(f"unknown decoder family {family!r}; known: {', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[family])
