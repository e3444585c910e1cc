"""Seeded synthetic MiniMax-H3 weights: the embedded tiny models."""

from __future__ import annotations

import math
from typing import Any

import torch

from app.families.minimax_h3.decoder.model import DEFAULTS, Architecture

SYNTHETIC: dict[str, dict[str, Any]] = {
    "minimax-h3-tiny": {
        **DEFAULTS,
        "decoder_num_layers": 2,
        "decoder_num_attention_heads": 2,
        "decoder_attention_head_dim": 16,
        "latents_mean": [round(0.1 * math.sin(i), 4) for i in range(24)],
        "latents_std": [round(1.0 + 0.2 * math.cos(i), 4) for i in range(24)],
    },
    # MiniMax-H3-Image: one frame per latent frame, RoPE over (h, w) only
    "minimax-h3-image-tiny": {
        **DEFAULTS,
        "patch_size_t": 1,
        "decoder_rope_axes": 2,
        "decoder_num_layers": 2,
        "decoder_num_attention_heads": 2,
        "decoder_attention_head_dim": 16,
        "latents_mean": [round(0.1 * math.cos(i), 4) for i in range(24)],
        "latents_std": [round(1.0 + 0.2 * math.sin(i), 4) for i in range(24)],
    },
}


@torch.no_grad()
def init_synthetic(decoder: Architecture, generator: torch.Generator) -> None:
    """Deterministic weights shaped like trained ones: unit-ish norms, fan-in
    scaled linears and small layer scales, so residual branches add small
    corrections (random default init would fail a bf16 parity gate)."""
    for name, p in sorted(decoder.named_parameters()):
        noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
        if name.endswith(("norm1.weight", "norm2.weight", "norm_out.weight")):
            value = 1.0 + 0.05 * noise
        elif name.endswith(("scale1", "scale2")):
            value = 0.05 + 0.02 * noise
        elif name.endswith("bias"):
            value = 0.02 * noise
        elif name.endswith("register_tokens"):
            value = 0.5 * noise
        else:
            value = noise / math.sqrt(p[0].numel())
        p.copy_(value)
