"""Seeded synthetic Wan weights: the embedded tiny Wan 2.1 / Qwen-Image / Wan 2.2 models."""

from __future__ import annotations

import math
from typing import Any

import torch

from app.families.wan.decoder.convert import WAN21_MEAN, WAN21_STD, WAN22_MEAN, WAN22_STD
from app.families.wan.decoder.model import Architecture, ResidualBlock, ResidualUpBlock, Upsampler

_TINY_21: dict[str, Any] = {
    "z_dim": 16,
    "decoder_base_dim": 8,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
    "is_residual": False,
    "out_channels": 3,
    "patch_size": None,
    "spatial_compression_ratio": 8,
    "latents_mean": WAN21_MEAN,
    "latents_std": WAN21_STD,
}
SYNTHETIC: dict[str, dict[str, Any]] = {
    # the Wan 2.1 / Qwen-Image topology in miniature
    "wan2.1-tiny": {**_TINY_21, "variant": "wan2.1", "fps": 16},
    "qwen-image-tiny": {**_TINY_21, "variant": "qwen-image", "fps": 16, "tiled_clamp": False},
    # Wan 2.2 TI2V: 48 channels, residual up blocks, 2x2 patch
    "wan2.2-tiny": {
        **_TINY_21,
        "variant": "wan2.2",
        "z_dim": 48,
        "decoder_base_dim": 8,
        "is_residual": True,
        "out_channels": 12,
        "patch_size": 2,
        "spatial_compression_ratio": 16,
        "latents_mean": WAN22_MEAN,
        "latents_std": WAN22_STD,
        "fps": 24,
    },
}


def init_synthetic(decoder: Architecture, generator: torch.Generator) -> None:
    """Deterministic trained-like weights: fan-in scaled convs, small biases, and each
    residual branch's last layer (resnet conv2, attention proj, Wan 2.2's upsampler conv
    beside its duplicate-up shortcut) scaled down x0.1, time convs near a frame copy, and
    an output bias (a mean colour, as images have)."""
    with torch.no_grad():
        for name, p in decoder.named_parameters():
            if name.endswith("gamma"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.01)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p[0].numel()))
        for module in decoder.modules():
            if isinstance(module, ResidualBlock):
                module.conv2.weight.mul_(0.1)
            elif isinstance(module, ResidualUpBlock) and module.upsampler is not None:
                module.upsampler.resample[1].weight.mul_(0.1)
            elif isinstance(module, Upsampler) and module.time_conv is not None:
                _near_copy(module.time_conv.weight)
        decoder.mid_block.attentions[0].proj.weight.mul_(0.1)
        decoder.conv_out.bias.copy_(
            torch.randn(decoder.conv_out.bias.shape, generator=generator) * 0.2
        )


def _near_copy(weight: torch.Tensor) -> None:
    """A temporal upsampler's time conv as Wan initialises it (each output half copies the
    current frame: identity on the last tap), plus the random part scaled x0.1."""
    half = weight.shape[0] // 2
    weight.mul_(0.1)
    eye = torch.eye(half, weight.shape[1], device=weight.device, dtype=weight.dtype)
    weight[:half, :, -1, 0, 0] += eye
    weight[half:, :, -1, 0, 0] += eye
