"""Seeded trained-like TAESD-family encoder weights, and the embedded synthetic configs."""

from __future__ import annotations

from typing import Any

import torch

from app.families.taesd.decoder.model import Block
from app.families.taesd.encoder.model import EncoderModel

SYNTHETIC: dict[str, dict[str, Any]] = {
    "taesd-synthetic": {"variant": "taesd"},
    "taef1-synthetic": {"variant": "taef1"},
    "taef2-synthetic": {"variant": "taef2"},
}


@torch.no_grad()
def init_synthetic(encoder: EncoderModel, generator: torch.Generator) -> None:
    """He-scaled convs (ReLU network), unit norms, zero biases, and small residual branches
    (each block's last conv and the pool's output conv scaled down), as trained nets have."""
    for name, param in encoder.named_parameters():
        if name.endswith(".bias"):
            param.zero_()
        elif param.ndim == 1:  # GroupNorm weights
            param.fill_(1.0)
        else:
            fan_in = param[0].numel()
            param.copy_(torch.randn(param.shape, generator=generator) * (2 / fan_in) ** 0.5)
    for module in encoder.modules():
        if isinstance(module, Block):
            module.conv[4].weight.mul_(0.1)
            if module.pool is not None:
                module.pool[3].weight.mul_(0.1)
