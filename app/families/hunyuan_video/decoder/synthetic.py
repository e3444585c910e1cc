"""Seeded synthetic HunyuanVideo weights: the embedded ``hunyuan-video-tiny`` model."""

from __future__ import annotations

import math
from typing import Any

import torch

from app.families.hunyuan_video.decoder.convert import SCALING_FACTOR
from app.families.hunyuan_video.decoder.model import Architecture, CausalAttention, ResnetBlock

SYNTHETIC: dict[str, dict[str, Any]] = {
    # the released topology (4 up blocks, 8x space, 4x time, causal mid attention) in miniature
    "hunyuan-video-tiny": {
        "latent_channels": 16,
        "out_channels": 3,
        "block_out_channels": [8, 16, 32, 32],
        "layers_per_block": 1,
        "norm_num_groups": 4,
        "spatial_compression_ratio": 8,
        "temporal_compression_ratio": 4,
        "mid_block_add_attention": True,
        "scaling_factor": SCALING_FACTOR,
        "fps": 24,
    },
}


def init_synthetic(decoder: Architecture, generator: torch.Generator) -> None:
    """Deterministic trained-like weights: fan-in scaled convs and projections, small biases,
    GroupNorm gains near 1, each residual branch's last layer (resnet ``conv2``, attention
    ``to_out``) scaled down x0.1, and an output bias (a mean colour, as images have)."""
    with torch.no_grad():
        for name, p in decoder.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + torch.randn(p.shape, generator=generator) * 0.05)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.01)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p[0].numel()))
        for module in decoder.modules():
            if isinstance(module, ResnetBlock):
                module.conv2.conv.weight.mul_(0.1)
            elif isinstance(module, CausalAttention):
                module.to_out[0].weight.mul_(0.1)
        decoder.conv_out.conv.bias.copy_(
            torch.randn(decoder.conv_out.conv.bias.shape, generator=generator) * 0.2
        )
