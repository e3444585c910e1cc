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

from typing import TYPE_CHECKING, Any

from torch import Tensor

from app.decoders.tiling import Grid

if TYPE_CHECKING:
    from app.decoders.wan.model import WanDecoder

DEFAULT_TILE_SAMPLE_SIZE = 256  # diffusers' tile_sample_min_height / _width
DEFAULT_TILE_SAMPLE_STRIDE = 192  # diffusers' tile_sample_stride_height / _width


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
