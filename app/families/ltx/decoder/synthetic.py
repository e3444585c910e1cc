"""Seeded synthetic LTX weights: the embedded ``ltx-tiny`` (0.9.1) and ``ltx2-tiny`` models."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from app.families.ltx.decoder import ltx2
from app.families.ltx.decoder.model import DEFAULT_FPS, DEFAULTS

SYNTHETIC: dict[str, dict[str, Any]] = {
    # The 0.9.1 topology in miniature: timestep conditioning, noise, residual 2x upsamplers.
    "ltx-tiny": {
        **DEFAULTS,
        "decoder_block_out_channels": [16, 32, 64],
        "decoder_layers_per_block": [1, 1, 1, 1],
        "decoder_spatio_temporal_scaling": [True, True, True],
        "decoder_inject_noise": [True, True, False, False],
        "upsample_residual": [True, True, True],
        "upsample_factor": [2, 2, 2],
        "timestep_conditioning": True,
        "decode_timestep": 0.05,
        "fps": DEFAULT_FPS,
    },
    # LTX-2's decoder in miniature: reflect padding, one upsampler of each kind (spatial,
    # temporal, both), residual 2x, causal, timestep conditioning and noise on.
    "ltx2-tiny": {
        **ltx2.DEFAULTS,
        "decoder_block_out_channels": [16, 32, 64],
        "decoder_layers_per_block": [1, 1, 1, 1],
        "decoder_inject_noise": [True, True, False, False],
        "upsample_type": ["spatial", "temporal", "spatiotemporal"],
        "timestep_conditioning": True,
        "decode_timestep": 0.05,
        "fps": DEFAULT_FPS,
    },
}


def init_synthetic(decoder: nn.Module, generator: torch.Generator) -> None:
    """Deterministic trained-like weights: fan-in scaled convs, each residual branch's last
    conv scaled down (x0.1), small noise scales and modulation tables."""
    with torch.no_grad():
        for name, p in decoder.named_parameters():
            p.copy_(_synthetic_value(name, p, generator))


def _synthetic_value(name: str, p: Tensor, gen: torch.Generator) -> Tensor:
    randn = torch.randn(p.shape, generator=gen)
    if name.endswith("timestep_scale_multiplier"):
        return torch.tensor(1000.0)
    if "norm3.weight" in name:
        return torch.ones(p.shape)
    if name.endswith("bias"):
        return randn * 0.01
    if "per_channel_scale" in name:
        return randn * 0.02
    if name.endswith("scale_shift_table"):
        return randn * 0.05
    fan_in = p[0].numel() if p.ndim > 1 else 1
    value = randn / math.sqrt(fan_in)
    if name.endswith("conv2.conv.weight"):
        value *= 0.1
    return value
