"""The TAESD family's ``Encoder``: the latent itself (deterministic), diffusers' tiles.

``moments`` is ``AutoencoderTiny.encode(x).latents`` for RGB in [-1, 1] (mapped to the
encoder's [0, 1] first, as diffusers does); ``tiled=True`` is its ``enable_tiling`` encode:
512 px tiles every 448 px, each written over the ones before it through a linear ramp.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from app.families.encoder_memory import Level, peak_values
from app.families.taesd.encoder.model import EncoderModel

# maps of a level's width live at once in one of its blocks: measured, with a margin
# (docs/encoders.md, "Memory")
MAPS_PER_FRAME = 4.5


class Encoder(EncoderModel):
    channels_last = True  # a served copy on the CPU: faster, less memory (docs/encoders.md)

    @property
    def latent_channels(self) -> int:
        return int(self.config["latent_channels"])

    @property
    def spatial_scale(self) -> int:
        return 2 ** (len(self.down) - 1)

    def moments(self, x: Tensor, tiled: bool = False, **options: Any) -> Tensor:
        if x.ndim != 4 or x.shape[1] != 3:
            raise ValueError(f"taesd encoder: expected pixels [B,3,H,W], got {list(x.shape)}")
        x = x.to(self.conv_in.weight.dtype).add(1).div(2)
        if tiled:
            return self._tiled(x, int(options.get("tile_sample_size") or 0))
        return self(x)

    def _tiled(self, x: Tensor, tile: int) -> Tensor:
        tile = tile or self.config["tile_sample_size"]
        scale = self.spatial_scale
        blend = int(tile * self.config["tile_overlap_factor"])
        if tile % scale or blend < 2 * scale:  # the ramp needs two cells to rise over
            raise ValueError(
                f"taesd encoder: tile_sample_size {tile} must be a multiple of {scale} "
                f"blending over at least {2 * scale} px"
            )
        step = tile - blend
        # Weights rise 0 -> 1 over the first blend/scale latent cells of a tile's top/left.
        ramp = (torch.arange(tile // scale) / (blend / scale - 1)).clamp(0, 1).to(x)
        batch, _, height, width = x.shape
        out = x.new_zeros(batch, self.latent_channels, height // scale, width // scale)
        for top in range(0, height, step):
            for left in range(0, width, step):
                z = self(x[..., top : top + tile, left : left + tile])
                target = out[..., top // scale :, left // scale :][
                    ..., : z.shape[-2], : z.shape[-1]
                ]
                h, w = target.shape[-2:]
                rows = ramp[:h] if top else torch.ones_like(ramp[:h])
                cols = ramp[:w] if left else torch.ones_like(ramp[:w])
                mask = rows[:, None] * cols[None, :]
                target.copy_(mask * z[..., :h, :w] + (1 - mask) * target)
        return out

    def stages(self) -> list[tuple[str, nn.Module]]:
        return [
            ("conv_in", self.conv_in),
            *((f"down_{i}", stage) for i, stage in enumerate(self.down)),
            ("conv_out", self.conv_out),
        ]

    def working_bytes(
        self, input_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        """The widest level's blocks (``memory``: the first, at full resolution), the input
        mapped to [0, 1] and the latent."""
        batch, height, width = input_shape[0], input_shape[-2], input_shape[-1]
        scale = self.spatial_scale
        latent = self.latent_channels * (height // scale) * (width // scale)
        values = peak_values(self._levels(batch, height, width), MAPS_PER_FRAME)
        return (values + batch * (3 * height * width + latent)) * element_size

    def _levels(self, batch: int, height: int, width: int) -> list[Level]:
        levels = []
        for channels in self.config["channels"]:
            levels.append(Level(channels, 1, batch * height * width, taps=9, pad_frames=0))
            height, width = (height + 1) // 2, (width + 1) // 2
        return levels

    def probe_input(self, generator: torch.Generator) -> Tensor:
        return torch.rand((1, 3, 64, 64), generator=generator) * 2 - 1
