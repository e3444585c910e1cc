"""Seeded trained-like HunyuanVideo encoder weights (``hunyuan-video-tiny``)."""

from __future__ import annotations

from typing import Any

import torch

from app.families import encoding
from app.families.hunyuan_video.encoder.encode import DEFAULTS, Encoder

SYNTHETIC: dict[str, dict[str, Any]] = {
    "hunyuan-video-tiny": {
        **DEFAULTS,
        "block_out_channels": [8, 16, 32, 32],
        "layers_per_block": 1,
        "norm_num_groups": 4,
    },
}


def init_synthetic(encoder: Encoder, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in encoder.named_parameters():
            p.copy_(encoding.synthetic_value(name, p, generator))
