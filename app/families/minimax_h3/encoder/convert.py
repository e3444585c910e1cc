"""Where MiniMax-H3 encoder weights come from: a diffusers ``vae/`` folder
(``AutoencoderKLMiniMaxH3``); its config's encoder and clip keys are kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from app.families import encoding
from app.families.minimax_h3.encoder.encode import DEFAULTS

CLASS = "AutoencoderKLMiniMaxH3"


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    raw, tensors = encoding.read_vae_folder(source)
    if raw.get("_class_name") != CLASS:
        raise ValueError(f"{source}: _class_name {raw.get('_class_name')!r} is not {CLASS}")
    config = {k: raw.get(k, v) for k, v in DEFAULTS.items()}
    return encoding.jsonable(config), encoding.encoder_state(tensors)
