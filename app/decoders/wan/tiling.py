"""Spatial tiles of a Wan decode, exactly as diffusers' ``AutoencoderKLWan.tiled_decode``.

The latent is cut into tiles of ``tile_sample_size // compression`` cells every
``tile_sample_stride // compression`` cells; each tile decodes on its own (its own temporal
stream), then each tile's top and left edges are blended, in place and in raster order, with
the already-blended tile above / to the left (linear ramps over ``size - stride`` output
pixels), and each tile keeps its top-left ``stride`` square. Blending is frame-local, so a
streamed decode blends each chunk of frames the same way. Wan 2.2 tiles and blends in the
patched (pre-unpatchify) space, as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from app.decoders.wan.model import WanDecoder

DEFAULT_TILE_SAMPLE_SIZE = 256  # diffusers' tile_sample_min_height / _width
DEFAULT_TILE_SAMPLE_STRIDE = 192  # diffusers' tile_sample_stride_height / _width


@dataclass
class Grid:
    tiles: list[tuple[slice, slice]]  # latent (rows, columns) of each tile, in raster order
    columns: int
    stride: int  # output pixels each tile keeps (patched space)
    blend_extent: int  # output pixels blended across a seam (patched space)
    out_hw: tuple[int, int]  # the whole frame (patched space)

    def blend(self, outs: list[Tensor]) -> Tensor:
        """Tile outputs (raster order) -> the frame; tiles are blended in place."""
        rows = [outs[i : i + self.columns] for i in range(0, len(outs), self.columns)]
        kept_rows = []
        for i, row in enumerate(rows):
            kept = []
            for j, tile in enumerate(row):
                if i > 0:
                    _blend_edge(rows[i - 1][j], tile, self.blend_extent, dim=-2)
                if j > 0:
                    _blend_edge(row[j - 1], tile, self.blend_extent, dim=-1)
                kept.append(tile[..., : self.stride, : self.stride])
            kept_rows.append(torch.cat(kept, dim=-1))
        return torch.cat(kept_rows, dim=-2)[..., : self.out_hw[0], : self.out_hw[1]]


def grid(decoder: WanDecoder, z: Tensor, options: dict[str, Any]) -> Grid | None:
    """The reference's tiles for latent ``z``; None when it fits in one tile (not tiled)."""
    size = int(options.get("tile_sample_size") or DEFAULT_TILE_SAMPLE_SIZE)
    stride = int(options.get("tile_sample_stride") or DEFAULT_TILE_SAMPLE_STRIDE)
    ratio = int(decoder.config.get("spatial_compression_ratio") or decoder.spatial_scale)
    patch = decoder.patch
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


def _blend_edge(prev: Tensor, tile: Tensor, extent: int, dim: int) -> None:
    """Ramp ``tile``'s first ``extent`` rows (dim -2) or columns (dim -1) from ``prev``'s last
    ones, in place: out[y] = prev[-e + y] * (1 - y/e) + tile[y] * (y/e)."""
    extent = min(prev.shape[dim], tile.shape[dim], extent)
    if extent <= 0:
        return
    ramp = torch.arange(extent, dtype=torch.float64) / extent
    shape = (-1, 1) if dim == -2 else (-1,)
    rise = ramp.to(tile.dtype).to(tile.device).view(shape)
    fall = (1 - ramp).to(tile.dtype).to(tile.device).view(shape)
    head = tile.narrow(dim, 0, extent)
    tail = prev.narrow(dim, prev.shape[dim] - extent, extent)
    head.copy_(tail * fall + head * rise)
