"""Seeded trained-like MiniMax-H3 encoder weights (``minimax-h3-tiny``: the released
geometry, 16x space and 4x time, at tiny widths)."""

from __future__ import annotations

import math
from typing import Any

import torch

from app.families import encoding
from app.families.minimax_h3.encoder.encode import DEFAULTS, Encoder

SYNTHETIC: dict[str, dict[str, Any]] = {
    "minimax-h3-tiny": {
        **DEFAULTS,
        "block_out_channels": [8, 8, 16, 16, 16, 16],
        "layers_per_block": 1,
        "norm_num_groups": 4,
        "latents_mean": [round(0.1 * math.sin(i), 4) for i in range(24)],
        "latents_std": [round(1.0 + 0.2 * math.cos(i), 4) for i in range(24)],
    },
}


def init_synthetic(encoder: Encoder, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in encoder.named_parameters():
            p.copy_(encoding.synthetic_value(name, p, generator))
