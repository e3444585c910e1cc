"""Seeded trained-like LTX encoder weights (``ltx-tiny``, ``ltx2-tiny``): fan-in scaled
convs, each residual branch's last conv scaled down, small biases."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from app.encoders.ltx.encode import DEFAULTS, LTX2_DEFAULTS, Encoder

SYNTHETIC: dict[str, dict[str, Any]] = {
    # 0.9.5's encoder in miniature: space-to-depth downsamplers of every kind
    "ltx-tiny": {
        **DEFAULTS,
        "block_out_channels": [16, 32, 64, 64],
        "down_block_types": ["LTXVideo095DownBlock3D"] * 4,
        "spatio_temporal_scaling": [True, True, True, False],
        "layers_per_block": [1, 1, 1, 1, 1],
        "downsample_type": ["spatial", "temporal", "spatiotemporal", "conv"],
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
            p.copy_(synthetic_value(name, p, generator))


def synthetic_value(name: str, p: Tensor, gen: torch.Generator) -> Tensor:
    """One parameter's seeded value (shared by the video encoder families)."""
    randn = torch.randn(p.shape, generator=gen)
    if p.ndim == 1 and "norm" in name and name.endswith(("weight", "gamma")):
        return 1 + randn * 0.02
    if name.endswith("bias"):
        return randn * 0.01
    fan_in = p[0].numel() if p.ndim > 1 else 1
    value = randn / math.sqrt(fan_in)
    if ".conv2." in name or name.endswith("conv2.weight"):
        value *= 0.1
    return value
