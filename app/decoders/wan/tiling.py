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

from app.decoders.tiling import Grid, sample_grid

if TYPE_CHECKING:
    from app.decoders.wan.model import WanDecoder


def grid(decoder: WanDecoder, z: Tensor, options: dict[str, Any]) -> Grid | None:
    """The reference's tiles for latent ``z``; None when it fits in one tile (not tiled)."""
    ratio = int(decoder.config.get("spatial_compression_ratio") or decoder.spatial_scale)
    return sample_grid(z, options, ratio, decoder.patch)
