"""The reference's tile and clip schedules (MiniMax-H3).

The tiling is part of the model's output, not a memory strategy: the reference always decodes
256-px spatial tiles, cross-faded (``split_tiles``, ``stitch_tiles``), and 17-frame temporal
clips: 3 dropped tokens, 5-token chunks, 2-token overlap (``clip_plan``, ``crossfade``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

TILE = 256  # pixel tile edge of the released model
TILE_MIN_OVERLAP = 64  # the smallest overlap the schedule accepts, pixels


def split_tiles(
    length: int, ratio: int, tile: int = TILE, min_overlap: int = TILE_MIN_OVERLAP
) -> tuple[list[int], list[int], list[int]]:
    """``(starts, lengths, overlaps)`` in pixels along one axis of ``length`` pixels.

    Every tile is exactly ``tile`` wide (or the whole axis when it fits): the
    reference grows the overlaps, in whole ``ratio`` steps handed out
    round-robin, rather than shrinking the last tile.
    """
    if tile >= length:
        return [0], [length], []
    count = -(-length // tile)
    while tile * count - min_overlap * (count - 1) < length:
        count += 1
    overlaps = [min_overlap] * (count - 1)
    slack = tile * count - sum(overlaps) - length
    for step in range(slack // ratio):
        overlaps[step % (count - 1)] += ratio
    starts = [0]
    for overlap in overlaps:
        starts.append(starts[-1] + tile - overlap)
    return starts, [tile] * count, overlaps


@dataclass(frozen=True)
class ClipPlan:
    """The temporal schedule of one decode, in latent frames and pixel frames."""

    pad_tokens: int  # repeats of the last latent frame appended before decoding
    clips: tuple[tuple[int, int], ...]  # latent-frame ranges, each decoded as one clip
    chunk_frames: int  # pixel frames of one chunk, pre-pad included (20)
    pre_pad: int  # leading pixel frames of each chunk that are cut (3)
    overlap: int  # pixel frames cross-faded between consecutive chunks (5)
    carries: bool  # whether each clip's tail is carried into the next (token_drop > 0)
    single: bool  # too short to chunk: one clip, pre-pad cut, nothing else
    frames: int  # pixel frames out


def clip_plan(
    latent_frames: int, patch_t: int, clip_length: int = 17, token_drop: int = 3
) -> ClipPlan:
    """The reference's clip bookkeeping for ``latent_frames`` latent frames.

    The encoder took ``clip_length``-frame clips and dropped ``token_drop``
    tokens off each, so the decoder plans over a longer pseudo-sequence,
    decodes overlapping clips of ``chunk + overlap`` tokens, cuts the pre-pad
    frames off each chunk, cross-fades the carried tail into the next chunk,
    and trims the frames the padding tokens manufactured.
    """
    chunk_tokens = -(-clip_length // patch_t)
    token_overlap = (-token_drop) % chunk_tokens
    pre_pad = (-clip_length) % patch_t
    overlap = max(token_overlap * patch_t - pre_pad, 0)
    chunk_frames = chunk_tokens * patch_t
    pseudo = latent_frames + token_drop
    pad = (-pseudo) % chunk_tokens
    count = (pseudo + pad) // chunk_tokens - int(token_drop > 0)
    if count < 1:
        # The reference has no answer here (it concatenates nothing); decode
        # the latent as one clip and cut the pre-pad, as the 5n+2 <-> 17n+5
        # geometry extends to n = 0 (2 latents -> 5 frames, 1 -> 1).
        frames = len(range(latent_frames * patch_t)[pre_pad:])
        return ClipPlan(
            0, ((0, latent_frames),), chunk_frames, pre_pad, overlap, False, True, frames
        )
    stop = latent_frames + pad
    clips = tuple(
        (i * chunk_tokens, min(i * chunk_tokens + chunk_tokens + token_overlap, stop))
        for i in range(count)
    )
    carries = token_drop > 0
    frames = 0
    tail = 0
    for start, end in clips:
        span = range((end - start) * patch_t)
        frames += len(span[:chunk_frames][pre_pad:])
        tail = len(span[chunk_frames : 2 * chunk_frames][pre_pad:]) if carries else 0
    frames += tail - _pad_frames(latent_frames, pad, chunk_tokens, patch_t, clip_length)
    return ClipPlan(pad, clips, chunk_frames, pre_pad, overlap, carries, False, frames)


def _pad_frames(
    latent_frames: int, pad: int, chunk_tokens: int, patch_t: int, clip_length: int
) -> int:
    """Pixel frames the padding tokens produced: a chunk's last token covers
    only ``clip_length % patch_t`` frames, every other token ``patch_t``."""
    tail = clip_length % patch_t
    return sum(
        tail if tail and (latent_frames + k) % chunk_tokens == 0 else patch_t for k in range(pad)
    )


def crossfade(a: Tensor, b: Tensor, extent: int, dim: int) -> Tensor:
    """``b`` with its first ``extent`` slices along ``dim`` linearly faded in
    from ``a``'s last ``extent`` slices (weights ``k/extent`` for ``b``)."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    if extent == 0:
        return b
    w = _ramp(extent, b, dim)
    mixed = a.narrow(dim, a.shape[dim] - extent, extent) * (1 - w) + b.narrow(dim, 0, extent) * w
    if extent == b.shape[dim]:
        return mixed
    return torch.cat((mixed, b.narrow(dim, extent, b.shape[dim] - extent)), dim=dim)


def _ramp(extent: int, like: Tensor, dim: int) -> Tensor:
    """``k / extent`` for ``k < extent``, shaped to broadcast along ``dim``."""
    shape = [1] * like.ndim
    shape[dim] = extent
    return (torch.arange(extent, device=like.device, dtype=like.dtype) / extent).view(shape)


def stitch_tiles(
    tiles: list[list[Tensor]],
    starts: tuple[list[int], list[int]],
    overlaps: tuple[list[int], list[int]],
    size: tuple[int, int],
) -> Tensor:
    """Blend a grid of equal tiles ``[..., th, tw]`` into a canvas of ``size`` pixels.

    The reference's order: each tile is faded in from the ORIGINAL tile above,
    then from the original tile to its left, and its trailing overlap is
    dropped (the next tile owns it). Done in place on the canvas, touching
    only the kept part of each tile, with the reference's arithmetic.
    """
    (ys, xs), (yo, xo) = starts, overlaps
    first = tiles[0][0]
    th, tw = first.shape[-2:]
    canvas = first.new_empty(first.shape[:-2] + size)
    for i, row in enumerate(tiles):
        h = th - (yo[i] if i < len(tiles) - 1 else 0)
        for j, tile in enumerate(row):
            w = tw - (xo[j] if j < len(row) - 1 else 0)
            region = canvas[..., ys[i] : ys[i] + h, xs[j] : xs[j] + w]
            region.copy_(tile[..., :h, :w])
            if i > 0:
                e = min(th, yo[i - 1])
                k = min(e, h)
                above = tiles[i - 1][j][..., th - e : th - e + k, :w]
                wy = _ramp(e, tile, -2)[..., :k, :]
                region[..., :k, :] = above * (1 - wy) + region[..., :k, :] * wy
            if j > 0:
                e = min(tw, xo[j - 1])
                k = min(e, w)
                left = row[j - 1][..., :h, tw - e : tw - e + k]
                wx = _ramp(e, tile, -1)[..., :k]
                region[..., :k] = left * (1 - wx) + region[..., :k] * wx
    return canvas
