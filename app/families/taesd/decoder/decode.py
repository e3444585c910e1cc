"""The TAESD family served: ``Decoder`` = ``model.Architecture`` behind ``VAEDecoder``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from app.families.decoder import VAEDecoder
from app.families.taesd.decoder import fast
from app.families.taesd.decoder.model import Architecture

# Working memory per output pixel, in values of the compute dtype per channel of the widest
# full-resolution stage (measured on the meta device: tests/test_memory_estimate.py): a block
# holds its input, two conv outputs and the sum.
VALUES_PER_PIXEL_PER_CHANNEL = 3.4


class Decoder(Architecture, VAEDecoder):
    """A TAESD-family decoder; ``decode`` returns RGB in about [0, 1], unclamped."""

    output_space = "unit"
    channels_last = True
    cpu_margin = 1.4  # the exact (NCHW) decoder's oneDNN copies (docs/decoders.md)

    @property
    def latent_channels(self) -> int:
        return int(self.config["latent_channels"])

    @property
    def spatial_scale(self) -> int:
        return 2 ** len(self.up)

    def working_bytes(
        self, latent_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        pixels = latent_shape[0] * latent_shape[-2] * latent_shape[-1] * self.spatial_scale**2
        width = self.config["channels"][-1]
        return int(pixels * width * VALUES_PER_PIXEL_PER_CHANNEL * element_size)

    def summary(self) -> dict[str, Any]:
        # "preview" lets a sampler pick this model for per-step previews from GET /models.
        return {**super().summary(), "preview": True, "variant": self.config["variant"]}

    def probe_latent(self, generator: torch.Generator, tiled: bool = False) -> Tensor:
        # A tiny decoder needs no 256-px probe: 128 px exercises every layer.
        return torch.randn((1, self.latent_channels, 16, 16), generator=generator)

    def decode(self, z: Tensor, **options: Any) -> Tensor:
        if z.ndim != 4 or z.shape[1] != self.latent_channels:
            raise ValueError(
                f"taesd: expected a latent [B,{self.latent_channels},H,W], got {list(z.shape)}"
            )
        return self(z.to(self.conv_in.weight.dtype))

    def optimize(self) -> None:
        fast.optimize(self)

    def stages(self) -> list[tuple[str, nn.Module]]:
        return [
            ("clamp", self.clamp),
            ("conv_in", self.conv_in),
            ("conv_in", self.act_in),
            ("mid", self.mid),
            *((f"up_{i}", stage) for i, stage in enumerate(self.up)),
            ("conv_out", self.conv_out),
        ]
