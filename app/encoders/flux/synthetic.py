"""Seeded trained-like FLUX-family encoder weights (the decoder's recipe: small residual
branches, unit norms, zero biases), and the embedded synthetic configs."""

from __future__ import annotations

from typing import Any

import torch

from app.decoders.flux.model import ResnetBlock, SpatialAttention
from app.encoders.flux.model import ENCODER_CONFIG, EncoderModel

SYNTHETIC: dict[str, dict[str, Any]] = {"flux1-synthetic": dict(ENCODER_CONFIG)}


@torch.no_grad()
def init_synthetic(encoder: EncoderModel, generator: torch.Generator) -> None:
    """Default-init random weights make every residual branch as large as its input (bf16
    then falls far below the parity threshold); trained VAEs add small corrections."""
    for name, param in encoder.named_parameters():
        if name.endswith(".bias"):
            param.zero_()
        elif "norm" in name:
            param.fill_(1.0)
        else:
            fan_in = param[0].numel()
            param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
    if encoder.bn is not None:  # FLUX.2: non-trivial latent statistics, like trained ones
        shape = encoder.bn.running_mean.shape
        encoder.bn.running_mean.copy_(0.5 * torch.randn(shape, generator=generator))
        encoder.bn.running_var.copy_(0.5 + 1.5 * torch.rand(shape, generator=generator))
    for module in encoder.modules():
        if isinstance(module, ResnetBlock):
            module.conv2.weight.mul_(0.1)
        elif isinstance(module, SpatialAttention):
            module.to_out[0].weight.mul_(0.1)
