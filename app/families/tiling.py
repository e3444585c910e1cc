"""Spatial tiles shared by the causal video families (wan, hunyuan-video), as diffusers'
``tiled_decode`` runs them: each tile decodes on its own; then, in raster order, each tile's
top and left edges are blended in place with the already-blended tile above / to the left
(linear ramps over ``blend_extent`` output pixels), and each tile keeps its top-left
``stride`` square."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

DEFAULT_TILE_SAMPLE_SIZE = 256  # diffusers' tile_sample_min_height / _width
DEFAULT_TILE_SAMPLE_STRIDE = 192  # diffusers' tile_sample_stride_height / _width


@dataclass
class Grid:
    tiles: list[tuple[slice, slice]]  # latent (rows, columns) of each tile, in raster order
    columns: int
    stride: int  # output pixels each tile keeps
    blend_extent: int  # output pixels blended across a seam
    out_hw: tuple[int, int]  # the whole frame

    def blend(self, outs: list[Tensor]) -> Tensor:
        """Tile outputs (raster order) -> the frames; tiles are blended in place."""
        rows = [outs[i : i + self.columns] for i in range(0, len(outs), self.columns)]
        kept_rows = []
        for i, row in enumerate(rows):
            kept = []
            for j, tile in enumerate(row):
                if i > 0:
                    blend_edge(rows[i - 1][j], tile, self.blend_extent, dim=-2)
                if j > 0:
                    blend_edge(row[j - 1], tile, self.blend_extent, dim=-1)
                kept.append(tile[..., : self.stride, : self.stride])
            kept_rows.append(torch.cat(kept, dim=-1))
        return torch.cat(kept_rows, dim=-2)[..., : self.out_hw[0], : self.out_hw[1]]


def blend_edge(prev: Tensor, tile: Tensor, extent: int, dim: int) -> None:
    """Ramp ``tile``'s first ``extent`` entries along ``dim`` (frames, rows or columns) from
    ``prev``'s last ones, in place: out[y] = prev[-e + y] * (1 - y/e) + tile[y] * (y/e)."""
    extent = min(prev.shape[dim], tile.shape[dim], extent)
    if extent <= 0:
        return
    ramp = torch.arange(extent, dtype=torch.float64) / extent
    shape = (-1,) + (1,) * (tile.ndim - 1 - (dim % tile.ndim))
    rise = ramp.to(tile.dtype).to(tile.device).view(shape)
    fall = (1 - ramp).to(tile.dtype).to(tile.device).view(shape)
    head = tile.narrow(dim, 0, extent)
    tail = prev.narrow(dim, prev.shape[dim] - extent, extent)
    head.copy_(tail * fall + head * rise)


def sample_grid(z: Tensor, options: dict[str, Any], ratio: int, patch: int = 1) -> Grid | None:
    """diffusers' tiles for latent ``z`` from its ``tile_sample_size`` / ``tile_sample_stride``
    options (output pixels; ``ratio`` pixels per latent cell), blended in the tiles' output
    space, which ``patch`` packs (Wan 2.2's); None when the latent fits in one tile."""
    size = int(options.get("tile_sample_size") or DEFAULT_TILE_SAMPLE_SIZE)
    stride = int(options.get("tile_sample_stride") or DEFAULT_TILE_SAMPLE_STRIDE)
    tile, step = size // ratio, stride // ratio
    h, w = z.shape[-2:]
    if h <= tile and w <= tile:
        return None
    ys, xs = range(0, h, step), range(0, w, step)
    return Grid(
        tiles=[(slice(y, y + tile), slice(x, x + tile)) for y in ys for x in xs],
        columns=len(xs),
        stride=stride // patch,
        blend_extent=size // patch - stride // patch,
        out_hw=(h * ratio // patch, w * ratio // patch),
    )
