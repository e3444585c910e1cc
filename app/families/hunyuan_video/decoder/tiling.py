"""Frame windows and spatial tiles of a HunyuanVideo decode, exactly as diffusers'
``AutoencoderKLHunyuanVideo`` (``_temporal_tiled_decode`` and ``tiled_decode``).

Windows (on by default in the reference: ``use_framewise_decoding``). A clip of more than
``window_frames // 4`` latent frames (16 // 4 = 4) is decoded in windows of that many plus
one latent frames, starting every ``window_stride // 4`` (12 // 4 = 3) latent frames. Every
window but the first drops its first output frame (the overlap frame, decoded causally from
less context); its first ``window_frames - window_stride`` (4) frames are then ramped from
the previous window's last ones (in place, previous window already blended), and each window
keeps its first ``window_stride`` frames (the first window one more). A window is decoded in
one pass (GroupNorm and attention span the window), and once decoded its kept frames are
final, so the service streams window by window holding only the previous window's tail.
A trailing window of one latent frame keeps nothing and is not decoded.

Tiles (``tiled=True``, diffusers' ``enable_tiling``): inside each window the latent is cut
into ``tile_sample_size // 8``-cell tiles every ``tile_sample_stride // 8`` cells, each tile
decoded on its own, then blended in place in raster order with the tile above and to the left
(ramps over ``size - stride`` pixels) and cropped to its top-left ``stride`` square.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from app.families.decoder import VAEDecoder
from app.families.tiling import Grid, sample_grid

DEFAULT_WINDOW_FRAMES = 16  # diffusers' tile_sample_min_num_frames
DEFAULT_WINDOW_STRIDE = 12  # diffusers' tile_sample_stride_num_frames


# --- frame windows ----------------------------------------------------------------------------
@dataclass
class Window:
    latent: slice  # latent frames decoded together
    drop_first: bool  # the first output frame is the previous window's
    keep: int  # output frames this window contributes (after the drop)


@dataclass
class Plan:
    windows: list[Window]
    blend: int  # output frames ramped from the previous window


def windows(decoder: VAEDecoder, frames: int, options: dict[str, Any]) -> Plan:
    """The reference's windows for a clip of ``frames`` latent frames."""
    size = int(options.get("window_frames") or DEFAULT_WINDOW_FRAMES)
    stride = int(options.get("window_stride") or DEFAULT_WINDOW_STRIDE)
    ratio = decoder.temporal_scale
    latent_size, latent_stride = size // ratio, stride // ratio
    total = decoder.frames_out(frames)
    if not options.get("windowed", True) or frames <= latent_size:
        return Plan([Window(slice(0, frames), False, total)], 0)
    plan, made = Plan([], size - stride), 0
    for start in range(0, frames, latent_stride):
        stop = min(start + latent_size + 1, frames)
        decoded = decoder.frames_out(stop - start) - (1 if start else 0)
        keep = min(stride + (0 if start else 1), decoded, total - made)
        if keep <= 0:
            continue  # a last window of one latent frame: nothing survives its drop
        plan.windows.append(Window(slice(start, stop), start > 0, keep))
        made += keep
    return plan


# --- spatial tiles ------------------------------------------------------------------------------
def grid(decoder: VAEDecoder, z: Tensor, options: dict[str, Any]) -> Grid | None:
    """The reference's tiles for latent ``z``; None when it fits in one tile (not tiled)."""
    ratio = int(decoder.config.get("spatial_compression_ratio") or decoder.spatial_scale)
    return sample_grid(z, options, ratio)
