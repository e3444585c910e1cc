"""A decoder family for the startup tests (registered in ``FAMILIES`` by the test):
HunyuanVideo's decoder, whose ``probe_latent(generator, tiled=True)`` is larger than one tile at
the decode's default tile geometry (2x2 tiles). With ``break_tiled`` in its config, the tiled
decode of an optimized copy is off by 0.5 (a fast path whose tiles are wrong)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from app.families import tiling
from app.families.hunyuan_video.decoder import Decoder as HunyuanVideoDecoder
from app.families.hunyuan_video.decoder import init_synthetic  # noqa: F401  (the family's baker)


class Decoder(HunyuanVideoDecoder):
    family = "tiled-hunyuan"

    def probe_latent(self, generator: torch.Generator, tiled: bool = False) -> Tensor:
        if not tiled:
            return super().probe_latent(generator)
        cells = tiling.DEFAULT_TILE_SAMPLE_SIZE // self.spatial_scale + 4
        return torch.randn((1, self.latent_channels, 1, cells, cells), generator=generator)

    optimized = False

    def optimize(self) -> None:
        super().optimize()
        self.optimized = True

    def decode(self, z: Tensor, **options: Any) -> Tensor:
        out = super().decode(z, **options)
        broken = self.optimized and self.config.get("break_tiled") and options.get("tiled")
        return out + 0.5 if broken else out
