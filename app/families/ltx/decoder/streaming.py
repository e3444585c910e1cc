"""LTX decoding as a stream: the model's own stages, run on frame chunks and spatial tiles.

Every layer is frame-local except the temporal convs, so the decoder runs as a stream: latent
frames go in ``chunk_frames`` at a time, each conv keeps the last two input frames of its
stream (its "carry"), a non-causal conv holds back its newest output until it has seen the
next frame (or the end), resnet and upsampler skips wait in a small FIFO for their delayed
branch, and stages hand frames on in bounded pieces. Memory is bounded by the chunk, not the
clip (carries are 2 frames per conv, FIFOs <= 2 frames per resnet).

  * Temporal chunks are EXACT for causal and non-causal decoders alike: the same arithmetic
    on shorter tensors, nothing recomputed or approximated. A non-causal decoder's first
    output waits for its temporal receptive field, so its stream starts late; a causal one
    yields as soon as a chunk is in.
  * Spatial tiles (``tiled=True``) are BLENDED: overlapping latent tiles, each with its own
    stream state, decoded separately and mixed with linear ramps across the overlap. The
    spatial receptive field is wider than any practical overlap, so seams are approximate
    (measurements: docs/families/ltx.md).

The stage modules are timed by their hooks (``Decoder.stages``); the blend here is timed
with ``timing.phase``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from app.families.ltx.decoder.model import Architecture, Conditioning, Stream
from app.telemetry import timing

Stage = Callable[[Tensor, "Stream"], Tensor]
Tile = tuple[int, int, int, int]  # (y0, x0, h, w) in latent cells


def stream(
    decoder: Architecture, z: Tensor, cond: Conditioning, options: dict[str, Any], scale: int
) -> Iterator[Tensor]:
    """Decode ``z [B,C,T,H,W]`` chunk by chunk (and tile by tile), yielding frames in order;
    ``scale``: output pixels per latent cell."""
    chunk = int(decoder.option(options, "chunk_frames", 2))
    tiles = _tiles(decoder, z, options)
    stages = _stages(decoder)
    streams = [Stream(cond, (t[0], t[1]), chunk) for t in tiles]
    step = chunk or z.shape[2]
    for start in range(0, z.shape[2], step):
        final = start + step >= z.shape[2]
        part = z[:, :, start : start + step]
        if len(tiles) == 1:
            yield from _flow(stages, part, streams[0], final)
            continue
        outs = [
            _decode_tile(stages, part, t, s, final) for t, s in zip(tiles, streams, strict=True)
        ]
        if outs[0] is not None:
            with timing.phase("blend"):
                blended = _blend(outs, tiles, z.shape[-2:], scale)
            yield blended


def _stages(decoder: Architecture) -> list[tuple[Stage, int]]:
    """(stage, temporal rate of its input relative to the latent), in order."""
    stages: list[tuple[Stage, int]] = [(decoder.conv_in, 1), (decoder.mid_block, 1)]
    rate = 1
    for block in decoder.up_blocks:
        stages.append((block, rate))
        rate *= block.time_stride
    stages.append((decoder.head, rate))
    return stages


def _flow(stages: list[tuple[Stage, int]], x: Tensor, s: Stream, final: bool) -> Iterator[Tensor]:
    """Push one latent chunk through every stage, in pieces of at most ``s.chunk`` latent
    frames' worth; ``final`` marks the stream's last chunk (each stage then flushes).

    Depth first: the deepest stage with pending input runs next, and a stage's output is
    referenced only by the queue of the stage after it, so memory is freed as it goes."""
    queues: list[deque[tuple[Tensor, bool]]] = [deque() for _ in range(len(stages) + 1)]
    queues[0].append((x, final))
    del x
    while any(queues):
        k = max(i for i, q in enumerate(queues) if q)
        piece, last = queues[k].popleft()
        if k == len(stages):
            yield piece
            continue
        stage, _ = stages[k]
        s.final = last
        y = stage(piece, s)
        del piece
        next_rate = stages[k + 1][1] if k + 1 < len(stages) else 0  # 0: the output
        queues[k + 1].extend(_pieces(y, last, next_rate, s))
        del y


def _pieces(y: Tensor, last: bool, rate: int, s: Stream) -> list[tuple[Tensor, bool]]:
    """Split a stage's output into the next stage's pieces; the last piece of the stream
    is passed on even when empty (the next stage must still flush)."""
    if not y.shape[2]:
        return [(y, True)] if last and rate else []
    parts = y.split(s.chunk * rate, dim=2) if (s.chunk and rate) else (y,)
    return [(p, last and i == len(parts) - 1) for i, p in enumerate(parts)]


# --- spatial tiles ----------------------------------------------------------------------------
def _tiles(decoder: Architecture, z: Tensor, options: dict[str, Any]) -> list[Tile]:
    """Latent tiles; one tile covering everything unless ``tiled``."""
    h, w = z.shape[-2:]
    if not decoder.option(options, "tiled", False):
        return [(0, 0, h, w)]
    size = int(decoder.option(options, "tile_size", 16))
    overlap = min(int(decoder.option(options, "tile_overlap", 4)), size // 2)
    ys, xs = _starts(h, size, overlap), _starts(w, size, overlap)
    return [(y, x, min(size, h), min(size, w)) for y in ys for x in xs]


def _decode_tile(
    stages: list[tuple[Stage, int]], part: Tensor, tile: Tile, s: Stream, final: bool
) -> Tensor | None:
    """This chunk's frames of one tile (None while its stream is still filling)."""
    y, x, h, w = tile
    pieces = list(_flow(stages, part[..., y : y + h, x : x + w], s, final))
    return torch.cat(pieces, 2) if pieces else None


def _blend(
    outs: list[Tensor | None], tiles: list[Tile], latent_hw: Sequence[int], sc: int
) -> Tensor:
    """Weighted mix of tile outputs: linear ramps across each overlap, normalized."""
    first = outs[0]
    assert first is not None
    b, c, t = first.shape[:3]
    out = first.new_zeros(b, c, t, latent_hw[0] * sc, latent_hw[1] * sc)
    norm = first.new_zeros(latent_hw[0] * sc, latent_hw[1] * sc)
    ys = sorted({tile[0] for tile in tiles})
    xs = sorted({tile[1] for tile in tiles})
    for (y, x, h, w), piece in zip(tiles, outs, strict=True):
        wy = _ramp(y, h, ys, sc, piece)
        wx = _ramp(x, w, xs, sc, piece)
        weight = wy[:, None] * wx[None, :]
        out[..., y * sc : (y + h) * sc, x * sc : (x + w) * sc] += piece * weight
        norm[y * sc : (y + h) * sc, x * sc : (x + w) * sc] += weight
    return out / norm


def _starts(n: int, size: int, overlap: int) -> list[int]:
    """Tile starts along one axis: fixed stride, the last tile flush with the end."""
    if n <= size:
        return [0]
    return list(range(0, n - size, size - overlap)) + [n - size]


def _ramp(start: int, size: int, starts: list[int], sc: int, like: Tensor) -> Tensor:
    """1-D weights of one tile: rising over the overlap with its predecessor, falling over
    the overlap with its successor (complementary ramps sum to 1)."""
    wgt = torch.ones(size * sc, dtype=like.dtype, device=like.device)

    def rise(ov: int) -> Tensor:
        return (torch.arange(ov, dtype=like.dtype, device=like.device) + 0.5) / ov

    i = starts.index(start)
    if i > 0:
        ov = (starts[i - 1] + size - start) * sc
        wgt[:ov] *= rise(ov)
    if i + 1 < len(starts):
        ov = (start + size - starts[i + 1]) * sc
        wgt[size * sc - ov :] *= 1 - rise(ov)
    return wgt
