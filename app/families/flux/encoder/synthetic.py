"""Seeded trained-like FLUX-family encoder weights (the decoder's recipe: small residual
branches, unit norms, zero biases), and the embedded synthetic configs."""

from __future__ import annotations

from typing import Any

import torch

from app.families.flux.decoder import synthetic as decoder_synthetic
from app.families.flux.encoder.model import ENCODER_CONFIG, EncoderModel

SYNTHETIC: dict[str, dict[str, Any]] = {"flux1-synthetic": dict(ENCODER_CONFIG)}


def init_synthetic(encoder: EncoderModel, generator: torch.Generator) -> None:
    """The decoder's ``init_synthetic``: it reads only the parameter names, the resnet and
    attention modules and FLUX.2's ``bn``, which the encoder has too."""
    decoder_synthetic.init_synthetic(encoder, generator)
