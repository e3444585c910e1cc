"""Seeded synthetic TAESD weights (for tests and the GPU proof's gate section).

None is embedded (``SYNTHETIC`` is empty): a preview decoder is only worth serving with its
trained weights, which ``python -m app import taesd`` brings in.
"""

from __future__ import annotations

from typing import Any

import torch

from app.families.taesd.decoder.model import Architecture

SYNTHETIC: dict[str, dict[str, Any]] = {}
TINY: dict[str, Any] = {"variant": "taef1"}  # the released topology; init_synthetic fills it


@torch.no_grad()
def init_synthetic(decoder: Architecture, generator: torch.Generator) -> None:
    """Fan-in scaled convs, zero biases, each block's last conv scaled down (x0.1)."""
    for name, param in decoder.named_parameters():
        if name.endswith(".bias"):
            param.zero_()
        elif name.endswith("weight") and param.ndim == 1:
            param.fill_(1.0)  # TAEF2's pool GroupNorm
        else:
            fan_in = param[0].numel()
            param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
    for name, module in decoder.named_modules():
        if name.endswith(".conv") and isinstance(module, torch.nn.Sequential):
            module[-1].weight.mul_(0.1)
