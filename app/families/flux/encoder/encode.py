"""The FLUX family's ``Encoder``: moments, diffusers-compatible tiles, latent normalisation.

``moments`` is ``AutoencoderKL.encode(x).latent_dist.parameters`` (``AutoencoderKLFlux2``'s
too): ``[mean, logvar]`` along channels, logvar unclamped. ``tiled=True`` runs the tiles
``enable_tiling`` runs: square pixel tiles of ``sample_size``, overlapping by
``tile_overlap_factor``, encoded one by one and blended in the latent (an approximation of
the untiled encode, exactly diffusers' approximation).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from app.families import ops, winograd
from app.families.encoder_memory import Level, peak_values
from app.families.flux.encoder.model import EncoderModel
from app.families.tiling import Grid

# maps of a level's width live at once in one of its resnets; the same with Winograd convs
# (``optimize``), and their buffers in transformed input blocks: measured, with a margin
# (docs/encoders.md, "Memory")
MAPS_PER_FRAME = 6.5
WINOGRAD_MAPS_PER_FRAME = 5.5
WINOGRAD_BLOCKS = 4.25


class Encoder(EncoderModel):
    channels_last = True  # a served copy on the CPU: faster, less memory (docs/encoders.md)

    # --- geometry -------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return int(self.config["latent_channels"])

    @property
    def spatial_scale(self) -> int:
        return 2 ** (len(self.config["block_out_channels"]) - 1)

    def latent_hw(self, height: int, width: int) -> tuple[int, int]:
        """The latent grid of an input (odd sizes round up: each downsample pads one pixel)."""
        for _ in range(len(self.config["block_out_channels"]) - 1):
            height, width = (height - 2) // 2 + 1, (width - 2) // 2 + 1
        return height, width

    # --- encoding -------------------------------------------------------
    def moments(self, x: Tensor, tiled: bool = False, **options: Any) -> Tensor:
        """``tiled``: diffusers' ``enable_tiling`` encode (only inputs larger than a tile)."""
        self._check_input(x)
        x = x.to(self.conv_in.weight.dtype)
        tile = int(options.get("tile_sample_size") or self._sample_size())
        if tiled and max(x.shape[-2:]) > tile:
            return self._tiled_moments(x, tile)
        return self(x)

    def _check_input(self, x: Tensor) -> None:
        if x.ndim != 4 or x.shape[1] != self.config["in_channels"]:
            raise ValueError(f"flux encoder: expected pixels [B,3,H,W], got {list(x.shape)}")
        if min(x.shape[-2:]) < self.spatial_scale:
            raise ValueError(
                f"flux encoder: input {x.shape[-2]}x{x.shape[-1]} is smaller than one latent "
                f"cell ({self.spatial_scale} px)"
            )

    def _sample_size(self) -> int:
        size = self.config["sample_size"]
        return int(size[0] if isinstance(size, (list, tuple)) else size)

    def _tiled_moments(self, x: Tensor, tile: int) -> Tensor:
        overlap = self.config["tile_overlap_factor"]
        step = int(tile * (1 - overlap))
        self._check_tiles(x.shape[-2:], tile, step)
        tile_latent = tile // self.spatial_scale
        blend = int(tile_latent * overlap)
        ys, xs = range(0, x.shape[-2], step), range(0, x.shape[-1], step)
        grid = Grid(
            tiles=[(slice(y, y + tile), slice(c, c + tile)) for y in ys for c in xs],
            columns=len(xs),
            stride=tile_latent - blend,
            blend_extent=blend,
            # diffusers keeps what the kept squares add up to: no final crop.
            out_hw=(x.shape[-2], x.shape[-1]),
        )
        return grid.blend([self(x[..., rows, cols]) for rows, cols in grid.tiles])

    def _check_tiles(self, hw: tuple[int, ...], tile: int, step: int) -> None:
        """Refuse tilings that cannot run (diffusers' raise mid-encode on them)."""
        scale = self.spatial_scale
        if tile % scale or tile < 4 * scale or step < scale:
            raise ValueError(
                f"flux encoder: tile_sample_size {tile} must be a multiple of "
                f"{scale} and at least {4 * scale}"
            )
        for size in hw:
            last = size - (size - 1) // step * step  # pixels of the last tile's strip
            if last < scale:
                raise ValueError(
                    f"flux encoder: with {tile} px tiles a {size} px side leaves a {last} px "
                    "last tile; encode untiled or pick another tile_sample_size"
                )

    def normalize(self, z: Tensor) -> Tensor:
        """FLUX.2: (patchify2x2(z) - bn mean) / bn std, unpatchified (the FLUX.2 pipeline's
        normalisation in the decoder's 32-channel layout); others: (z - shift) * scale."""
        if self.bn is None:
            shift = self.config.get("shift_factor") or 0.0
            return (z - shift) * self.config["scaling_factor"]
        eps = self.config.get("batch_norm_eps", 1e-4)
        std = torch.sqrt(self.bn.running_var + eps).view(1, -1, 1, 1).to(z)
        mean = self.bn.running_mean.view(1, -1, 1, 1).to(z)
        return ops.unpatchify2x2((ops.patchify2x2(z) - mean) / std)

    # --- service hooks --------------------------------------------------
    def stages(self) -> list[tuple[str, nn.Module]]:
        return [
            ("conv_in", self.conv_in),
            *((f"down_{i}", block) for i, block in enumerate(self.down_blocks)),
            ("mid", self.mid_block),
            *(("conv_out", m) for m in (self.conv_norm_out, self.conv_act, self.conv_out)),
            *(("conv_out", m) for m in (self.quant_conv,) if m is not None),
        ]

    def working_bytes(
        self, input_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        """The widest level's resnet (``memory``: the first, at full resolution, but on a
        tiny input), with the Winograd convs' block buffers where ``optimize`` prepared
        them, and the moments. The mid attention holds O(H*W) (``attend``)."""
        batch, height, width = input_shape[0], input_shape[-2], input_shape[-1]
        h, w = self.latent_hw(height, width)
        moments = batch * 2 * self.latent_channels * h * w
        levels = self._levels(batch, height, width)
        if not self._runs_winograd():
            return (peak_values(levels, MAPS_PER_FRAME) + moments) * element_size
        # a transformed block: 36 values per 4x4 output tile, at most TRANSFORMED_BLOCK_BYTES
        frame = 36 * levels[0].pixels * levels[0].width // 16
        block = min(winograd.TRANSFORMED_BLOCK_BYTES // element_size, frame)
        values = peak_values(levels, WINOGRAD_MAPS_PER_FRAME) + int(WINOGRAD_BLOCKS * block)
        return (values + moments) * element_size

    def _runs_winograd(self) -> bool:
        """Whether the full-resolution resnets' convs run by Winograd (``optimize``)."""
        return getattr(self.down_blocks[0].resnets[0].conv1, "winograd", None) is not None

    def _levels(self, batch: int, height: int, width: int) -> list[Level]:
        levels = []
        for channels in self.config["block_out_channels"]:
            levels.append(Level(channels, 1, batch * height * width, taps=9, pad_frames=0))
            height, width = (height - 2) // 2 + 1, (width - 2) // 2 + 1  # as ``latent_hw``
        return levels

    def optimize(self) -> None:
        """The decoder's rewrites that apply to the encoder: in-place SiLU (each reads a fresh
        GroupNorm output) and, on a CPU in float32, the resnets' 3x3 convs by Winograd
        (``app.families.winograd``: not bit-exact, so served behind the gate). The stride-2
        downsample convs stay direct."""
        for module in self.modules():
            if isinstance(module, nn.SiLU):
                module.inplace = True
        for resnets in (self.mid_block.resnets, *(b.resnets for b in self.down_blocks)):
            winograd.prepare(resnets)

    def probe_input(self, generator: torch.Generator) -> Tensor:
        # 64 px reaches every layer (8x8 latent) and keeps the gate cheap.
        return torch.rand((1, 3, 64, 64), generator=generator) * 2 - 1
