"""Seeded trained-like Wan encoder weights (``wan2.1-tiny``, ``qwen-image-tiny``,
``wan2.2-tiny``): the decoders' tiny configs' encoder halves."""

from __future__ import annotations

from typing import Any

import torch

from app.families import encoding
from app.families.wan.decoder.convert import WAN21_MEAN, WAN21_STD, WAN22_MEAN, WAN22_STD
from app.families.wan.encoder.encode import DEFAULTS, Encoder

_TINY_21: dict[str, Any] = {
    **DEFAULTS,
    "base_dim": 8,
    "num_res_blocks": 1,
    "latents_mean": WAN21_MEAN,
    "latents_std": WAN21_STD,
}
SYNTHETIC: dict[str, dict[str, Any]] = {
    "wan2.1-tiny": {**_TINY_21, "variant": "wan2.1"},
    "qwen-image-tiny": {**_TINY_21, "variant": "qwen-image"},
    # Wan 2.2 TI2V: 48 channels, residual down blocks, 2x2 patch (12 input channels)
    "wan2.2-tiny": {
        **_TINY_21,
        "variant": "wan2.2",
        "z_dim": 48,
        "is_residual": True,
        "in_channels": 12,
        "patch_size": 2,
        "spatial_compression_ratio": 16,
        "latents_mean": WAN22_MEAN,
        "latents_std": WAN22_STD,
    },
}


def init_synthetic(encoder: Encoder, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in encoder.named_parameters():
            p.copy_(encoding.synthetic_value(name, p, generator))
