"""Seeded trained-like LTX encoder weights (``ltx-tiny``, ``ltx2-tiny``): fan-in scaled
convs, each residual branch's last conv scaled down, small biases."""

from __future__ import annotations

from typing import Any

import torch

from app.families import encoding
from app.families.ltx.encoder.encode import DEFAULTS, LTX2_DEFAULTS, Encoder

SYNTHETIC: dict[str, dict[str, Any]] = {
    # 0.9.5's encoder in miniature: space-to-depth downsamplers of every kind, to the
    # decoder's x32 in space and x8 in time (0.9.5's own downsamplers)
    "ltx-tiny": {
        **DEFAULTS,
        "block_out_channels": [16, 32, 64, 64, 64],
        "down_block_types": ["LTXVideo095DownBlock3D"] * 4,
        "spatio_temporal_scaling": [True, True, True, True],
        "layers_per_block": [1, 1, 1, 1, 1],
        "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatiotemporal"],
        # as 0.9.5's config says it (diffusers' default counts the spatial downsampler too)
        "temporal_compression_ratio": 8,
    },
    # LTX-2's encoder in miniature
    "ltx2-tiny": {
        **LTX2_DEFAULTS,
        "block_out_channels": [16, 32, 64, 64],
        "layers_per_block": [1, 1, 1, 1, 1],
        "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatial"],
        "spatio_temporal_scaling": [True, True, True, False],
    },
}


def init_synthetic(encoder: Encoder, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in encoder.named_parameters():
            p.copy_(encoding.synthetic_value(name, p, generator))
