"""A decoder family for the startup tests (``app.families.register("tiled-hunyuan", ...)`` by
the test; ``FAMILY`` its descriptor):
HunyuanVideo's decoder, whose ``probe_latent(generator, tiled=True)`` is larger than one tile at
the decode's default tile geometry (2x2 tiles). With ``break_tiled`` in its config, the tiled
decode of an optimized copy is off by 0.5 (a fast path whose tiles are wrong). A bf16 copy
computes with its weights in float32 (``tests.float32_twin``): the gate's mechanics are the
test, not bf16 arithmetic, which some CPUs emulate at minutes per tiled probe."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from app.families import tiling
from app.families.descriptor import Family, Part
from app.families.hunyuan_video.decoder import Decoder as HunyuanVideoDecoder
from app.families.hunyuan_video.decoder import convert, init_synthetic
from tests.float32_twin import Float32Twin


class Decoder(Float32Twin, HunyuanVideoDecoder):
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


FAMILY = Family("tiled-hunyuan", decoder=Part(Decoder, convert, init_synthetic))
