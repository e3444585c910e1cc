"""MiniMax-H3's ViT3D VAE decoder (video) and its image variant.

Every latent cell is one token; a stack of pre-norm transformer blocks (RMSNorm,
weightless q/k RMSNorm, RoPE on the first ``rope_dim_ratio`` of each head,
SwiGLU, layer scales) runs over a tile's tokens plus learned register tokens and
one all-zero token, and a LayerNorm + linear head expands each cell into a
``patch_t x patch x patch`` RGB block (ImageNet-normalized).

The tiling is part of the model's output, not a memory strategy: the reference
always decodes 256-px spatial tiles (cross-faded) and 17-frame temporal clips
(3 dropped tokens, 5-token chunks, 2-token overlap). Both schedules are the
module-level functions ``split_tiles`` and ``clip_plan``.

State-dict names are diffusers' (``AutoencoderKLMiniMaxH3``) decoder half.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from app.decoders.base import VAEDecoder
from app.timing import NULL_TIMER, PhaseTimer

TILE = 256  # pixel tile edge of the released model
TILE_MIN_OVERLAP = 64  # the smallest overlap the schedule accepts, pixels
DEFAULT_BATCH_TOKENS = 16384  # tokens per block-stack call when tiles are batched

DEFAULTS: dict[str, Any] = {
    "latent_channels": 24,
    "out_channels": 3,
    "patch_size": 16,
    "patch_size_t": 4,
    "decoder_num_layers": 36,
    "decoder_num_attention_heads": 32,
    "decoder_attention_head_dim": 64,
    "decoder_num_register_tokens": 4,
    "decoder_ffn_mult": 4,
    "decoder_rope_theta": 100.0,
    "decoder_rope_dim_ratio": 0.75,
    "decoder_rope_axes": 3,  # 3 = (t, h, w) video; 2 = (h, w) MiniMax-H3-Image
    "decoder_norm_eps": 1e-5,
    "clip_length": 17,
    "token_drop": 3,
    "latents_mean": None,  # None = zeros
    "latents_std": None,  # None = ones
}

# Parameters the reference pins to float32 whatever the compute dtype.
_FP32_SUFFIXES = (
    "norm1.weight",
    "norm2.weight",
    "norm_out.weight",
    "norm_out.bias",
    "scale1",
    "scale2",
)

Phase = Callable[[str], AbstractContextManager[None]]


def _no_phase(name: str) -> AbstractContextManager[None]:
    return nullcontext()


# --- schedules --------------------------------------------------------------


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


# --- layers -----------------------------------------------------------------


def _rope_tables(
    grid: tuple[int, ...], extra: int, rope_dim: int, theta: float, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``cos, sin`` of shape ``[tokens, 1, rope_dim]`` for a ``grid`` of cells
    (then ``extra`` suffix tokens at the origin).

    Coordinates are cell centres normalized to [-1, 1) per axis (so they
    depend on the tile's extent, not the frame's), times 2*pi; each axis gets
    ``rope_dim / (2 * axes)`` frequencies, axis-major, the list duplicated for
    the rotate-half pairing.
    """
    axes = len(grid)
    freqs = rope_dim // (2 * axes)
    inv_freq = 1.0 / theta ** (
        torch.arange(freqs, dtype=torch.float32, device=device) * (2 * axes / rope_dim)
    )
    centres = [
        2.0 * (torch.arange(n, dtype=torch.float32, device=device) + 0.5) / n - 1.0 for n in grid
    ]
    pos = torch.stack(torch.meshgrid(*centres, indexing="ij"), dim=-1).reshape(-1, axes)
    pos = torch.cat((pos, pos.new_zeros(extra, axes)))
    angles = (2.0 * math.pi * pos[:, :, None] * inv_freq).flatten(1).repeat(1, 2)
    return angles.cos()[:, None], angles.sin()[:, None]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on the first ``cos.shape[-1]`` channels of ``x [..., N, H, D]``."""
    r = cos.shape[-1]
    head, rest = x[..., :r], x[..., r:]
    lo, hi = head.chunk(2, dim=-1)
    turned = torch.cat((-hi, lo), dim=-1)
    return torch.cat((head * cos + turned * sin, rest), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])  # diffusers' name: to_out.0

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], phase: Phase) -> Tensor:
        b, n, _ = x.shape
        with phase("qkv"):
            q, k, v = (
                p(x).view(b, n, self.heads, self.head_dim)
                for p in (self.to_q, self.to_k, self.to_v)
            )
            q, k = (self._norm_rotate(t, rope) for t in (q, k))
        with phase("attention"):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            )
        with phase("out"):
            return self.to_out[0](out.transpose(1, 2).reshape(b, n, -1))

    def _norm_rotate(self, t: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        # weightless RMSNorm in float32, as the reference, then RoPE in compute dtype
        t = F.rms_norm(t.float(), (self.head_dim,), eps=self.eps).to(t.dtype)
        cos, sin = rope
        return _rotate(t, cos.to(t.dtype), sin.to(t.dtype))


class SwiGLU(nn.Module):
    """The gated input projection, ``[value; gate]`` rows (diffusers' order)."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 2 * inner)

    def forward(self, x: Tensor) -> Tensor:
        value, gate = self.proj(x).chunk(2, dim=-1)
        return value * F.silu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        # indices match diffusers' FeedForward.net: 0 = gated proj, 1 = dropout, 2 = out
        self.net = nn.ModuleList(
            [SwiGLU(dim, mult * dim), nn.Identity(), nn.Linear(mult * dim, dim)]
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](self.net[0](x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, mult: int, eps: float) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=eps)
        self.attn = Attention(dim, heads, head_dim, eps)
        self.scale1 = nn.Parameter(torch.zeros(dim))
        self.norm2 = nn.RMSNorm(dim, eps=eps)
        self.ff = FeedForward(dim, mult)
        self.scale2 = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], phase: Phase) -> Tensor:
        """``x`` is the float32 residual stream; branches run in the linears' dtype."""
        dtype = self.attn.to_q.weight.dtype
        with phase("norm"):
            h = self._norm(self.norm1, x).to(dtype)
        x = x + self.attn(h, rope, phase) * self.scale1.float()
        with phase("norm"):
            h = self._norm(self.norm2, x).to(dtype)
        with phase("ffn"):
            return x + self.ff(h) * self.scale2.float()

    @staticmethod
    def _norm(norm: nn.RMSNorm, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), norm.normalized_shape, norm.weight.float(), norm.eps)


class ViTDecoder(nn.Module):
    """The token stack; ``Decoder`` owns tiling, chunking and the post-quant conv."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        heads, head_dim = cfg["decoder_num_attention_heads"], cfg["decoder_attention_head_dim"]
        dim = heads * head_dim
        pixels = cfg["out_channels"] * cfg["patch_size_t"] * cfg["patch_size"] ** 2
        self.proj_in = nn.Linear(cfg["latent_channels"], dim)
        self.register_tokens = nn.Parameter(torch.zeros(1, cfg["decoder_num_register_tokens"], dim))
        self.transformer_blocks = nn.ModuleList(
            Block(dim, heads, head_dim, cfg["decoder_ffn_mult"], cfg["decoder_norm_eps"])
            for _ in range(cfg["decoder_num_layers"])
        )
        self.norm_out = nn.LayerNorm(dim, eps=cfg["decoder_norm_eps"])
        self.proj_out = nn.Linear(dim, pixels)


# --- the decoder --------------------------------------------------------------


def _is_image(config: dict[str, Any]) -> bool:
    return int(config.get("decoder_rope_axes", 3)) == 2


class Decoder(VAEDecoder):
    """MiniMax-H3 video decoder: ``[B,C,T,h,w]`` latents -> ``[B,3,T',16h,16w]``.

    Constructing it from an image config (``decoder_rope_axes: 2``) returns an
    ``ImageDecoder``, so ``is_video`` stays a true class attribute.
    """

    family: ClassVar[str] = "minimax-h3"
    output_space = "imagenet"
    is_video = True

    def __new__(cls, config: dict[str, Any] | None = None, *args: Any, **kwargs: Any) -> Decoder:
        if cls is Decoder and config is not None and _is_image(config):
            cls = ImageDecoder
        return super().__new__(cls)

    def __init__(self, config: dict[str, Any]) -> None:
        cfg = {**DEFAULTS, **config}
        c = cfg["latent_channels"]
        cfg["latents_mean"] = [float(v) for v in (cfg["latents_mean"] or [0.0] * c)]
        cfg["latents_std"] = [float(v) for v in (cfg["latents_std"] or [1.0] * c)]
        super().__init__(cfg)
        self.post_quant_conv = nn.Conv3d(c, c, kernel_size=1)
        self.decoder = ViTDecoder(cfg)
        self._rope_cache: dict[tuple[Any, ...], tuple[Tensor, Tensor]] = {}

    # --- geometry ---------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return int(self.config["latent_channels"])

    @property
    def spatial_scale(self) -> int:
        return int(self.config["patch_size"])

    @property
    def temporal_scale(self) -> int:
        return int(self.config["patch_size_t"])

    def frames_out(self, latent_frames: int) -> int:
        return self.plan(latent_frames).frames

    def plan(self, latent_frames: int) -> ClipPlan:
        cfg = self.config
        return clip_plan(latent_frames, cfg["patch_size_t"], cfg["clip_length"], cfg["token_drop"])

    def summary(self) -> dict[str, Any]:
        cfg = self.config
        heads = cfg["decoder_num_attention_heads"]
        return super().summary() | {
            "variant": "video" if self.is_video else "image",
            "layers": cfg["decoder_num_layers"],
            "dim": heads * cfg["decoder_attention_head_dim"],
            "heads": heads,
        }

    def probe_latent(self, generator: torch.Generator) -> Tensor:
        # one full 256-px tile, one latent frame: a few hundred tokens
        cells = max(1, TILE // self.spatial_scale)
        return torch.randn((1, self.latent_channels, 1, cells, cells), generator=generator)

    def denormalize(self, z: Tensor) -> Tensor:
        """``z * latents_std + latents_mean`` per channel, as the pipeline does."""
        shape = (1, -1) + (1,) * (z.ndim - 2)
        mean = torch.tensor(self.config["latents_mean"], device=z.device).view(shape)
        std = torch.tensor(self.config["latents_std"], device=z.device).view(shape)
        return z * std + mean

    def to(self, *args: Any, **kwargs: Any) -> Decoder:
        # channels_last means nothing to a token decoder, and the 5-D
        # post_quant_conv weight rejects it: ignore the request
        kwargs.pop("memory_format", None)
        return super().to(*args, **kwargs)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Decoder:
        # Casting to a lower dtype keeps the norms and layer scales in float32,
        # as the reference pins them (`_keep_in_fp32_modules`).
        pinned = {
            name: p.data
            for name, p in self.named_parameters()
            if name.endswith(_FP32_SUFFIXES) and p.dtype == torch.float32
        }
        super()._apply(fn, recurse)
        for name, p in self.named_parameters():
            if name in pinned and p.dtype != torch.float32:
                p.data = pinned[name].to(p.device)
        self._rope_cache = {}
        return self

    # --- decoding ---------------------------------------------------------
    def decode(self, z: Tensor, timer: PhaseTimer = NULL_TIMER, **options: Any) -> Tensor:
        return torch.cat(list(self.iter_decode(z, timer, **options)), dim=2)

    def iter_decode(
        self, z: Tensor, timer: PhaseTimer = NULL_TIMER, **options: Any
    ) -> Iterator[Tensor]:
        """Yield ``[B,3,t,H,W]`` frame chunks in order, as each clip is decoded.

        ``options``: ``fine_phases`` (time norm/qkv/attention/out/ffn instead
        of ``blocks``), ``max_batch_tokens`` (tiles batched per block-stack call).
        """
        z = self._check(z if z.ndim == 5 else z.unsqueeze(2))
        plan = self.plan(z.shape[2])
        if plan.pad_tokens:
            z = torch.cat((z, z[:, :, -1:].expand(-1, -1, plan.pad_tokens, -1, -1)), dim=2)
        left = plan.frames

        def emit(frames: Tensor) -> Tensor:
            nonlocal left
            frames = frames[:, :, :left]
            left -= frames.shape[2]
            return frames.contiguous()

        if plan.single:
            yield emit(self._decode_clip(z, timer, options)[:, :, plan.pre_pad :])
            return
        carry: Tensor | None = None
        cf = plan.chunk_frames
        for start, stop in plan.clips:
            clip = self._decode_clip(z[:, :, start:stop], timer, options)
            with timer.phase("chunk_blend"), torch.no_grad():
                head = clip[:, :, :cf][:, :, plan.pre_pad :]
                if carry is not None:
                    head = crossfade(carry, head, plan.overlap, dim=2)
                carry = clip[:, :, cf : 2 * cf][:, :, plan.pre_pad :] if plan.carries else None
                head = emit(head)
            if head.shape[2]:
                yield head
        if carry is not None and left > 0:
            yield emit(carry)

    def _check(self, z: Tensor) -> Tensor:
        if z.ndim != 5 or z.shape[1] != self.latent_channels or 0 in z.shape:
            raise ValueError(
                f"expected a latent [B,{self.latent_channels},T,H,W] (or [B,C,H,W]), "
                f"got {list(z.shape)}"
            )
        return z.to(self.post_quant_conv.weight.dtype)

    @torch.no_grad()
    def _decode_clip(self, z: Tensor, timer: PhaseTimer, options: dict[str, Any]) -> Tensor:
        """One temporal clip ``[B,C,t,h,w]``, spatially tiled and blended."""
        r = self.spatial_scale
        height, width = z.shape[-2] * r, z.shape[-1] * r
        ys, yl, yo = split_tiles(height, r)
        xs, xl, xo = split_tiles(width, r)
        th, tw = yl[0] // r, xl[0] // r
        # every tile has the same shape: decode them as one batch of sequences
        subs = [z[..., y // r : y // r + th, x // r : x // r + tw] for y in ys for x in xs]
        out = self._decode_tiles(torch.cat(subs), timer, options)
        grid = out.unflatten(0, (len(ys), len(xs), z.shape[0]))
        tiles = [[grid[i, j] for j in range(len(xs))] for i in range(len(ys))]
        with timer.phase("tile_blend"):
            if len(ys) * len(xs) == 1:
                return tiles[0][0]
            return stitch_tiles(tiles, (ys, xs), (yo, xo), (height, width))

    def _decode_tiles(self, z: Tensor, timer: PhaseTimer, options: dict[str, Any]) -> Tensor:
        """``[S,C,t,h,w]`` independent tiles -> ``[S,3,t*pt,h*p,w*p]``, in groups."""
        _, _, t, h, w = z.shape
        tokens = t * h * w + self.decoder.register_tokens.shape[1] + 1
        budget = int(options.get("max_batch_tokens") or DEFAULT_BATCH_TOKENS)
        group = max(1, budget // tokens)
        rope = self._rope((t, h, w), z.device)
        parts = [self._decode_group(part, rope, timer, options) for part in z.split(group)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode_group(
        self, z: Tensor, rope: tuple[Tensor, Tensor], timer: PhaseTimer, options: dict[str, Any]
    ) -> Tensor:
        dec = self.decoder
        b, c, t, h, w = z.shape
        cells = t * h * w
        with timer.phase("embed"):
            # the 1x1x1 conv as a conv (not a linear): the same rounding as the reference in bf16
            x = self.post_quant_conv(z).permute(0, 2, 3, 4, 1).reshape(b, cells, c)
            x = dec.proj_in(x)
            registers = dec.register_tokens.to(x.dtype).expand(b, -1, -1)
            # the residual stream is float32, as the reference's layer scales make it
            x = torch.cat((x, registers, x.new_zeros(b, 1, x.shape[-1])), dim=1).float()
        if options.get("fine_phases"):
            for block in dec.transformer_blocks:
                x = block(x, rope, timer.phase)
        else:
            with timer.phase("blocks"):
                for block in dec.transformer_blocks:
                    x = block(x, rope, _no_phase)
        with timer.phase("head"):
            # norm and projection are per token: drop the suffix tokens first
            x = dec.norm_out(x[:, :cells].float()).to(dec.proj_out.weight.dtype)
            x = dec.proj_out(x)
        with timer.phase("unpatchify"):
            return self._unpatchify(x, (t, h, w))

    def _unpatchify(self, x: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """``[B, t*h*w, 3*pt*p*p]`` -> ``[B, 3, t*pt, h*p, w*p]``."""
        t, h, w = grid
        pt, p = self.temporal_scale, self.spatial_scale
        x = x.view(x.shape[0], t, h, w, -1, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(x.shape[0], x.shape[1], t * pt, h * p, w * p)

    def _rope(self, grid: tuple[int, int, int], device: torch.device) -> tuple[Tensor, Tensor]:
        axes = int(self.config["decoder_rope_axes"])
        key = (grid, str(device))
        if key not in self._rope_cache:
            cfg = self.config
            rope_dim = int(cfg["decoder_attention_head_dim"] * cfg["decoder_rope_dim_ratio"])
            extra = cfg["decoder_num_register_tokens"] + 1
            self._rope_cache[key] = _rope_tables(
                grid[3 - axes :], extra, rope_dim, cfg["decoder_rope_theta"], device
            )
        return self._rope_cache[key]


class ImageDecoder(Decoder):
    """MiniMax-H3-Image: ``patch_size_t`` 1, RoPE over (h, w) only.

    Takes ``[B,C,H,W]`` and returns ``[B,3,16H,16W]``; a ``[B,C,T,H,W]`` stack
    is decoded frame by frame (each frame one image) into ``[B,3,T,16H,16W]``.
    """

    is_video = False

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        if self.config["patch_size_t"] != 1:
            raise ValueError("the image variant needs patch_size_t 1")

    def frames_out(self, latent_frames: int) -> int:
        return latent_frames

    def probe_latent(self, generator: torch.Generator) -> Tensor:
        cells = max(1, TILE // self.spatial_scale)
        return torch.randn((1, self.latent_channels, cells, cells), generator=generator)

    def decode(self, z: Tensor, timer: PhaseTimer = NULL_TIMER, **options: Any) -> Tensor:
        if z.ndim == 4:
            return self._decode_clip(self._check(z.unsqueeze(2)), timer, options).squeeze(2)
        return torch.cat(list(self.iter_decode(z, timer, **options)), dim=2)

    def iter_decode(
        self, z: Tensor, timer: PhaseTimer = NULL_TIMER, **options: Any
    ) -> Iterator[Tensor]:
        """One ``[B,3,1,H,W]`` chunk per latent frame."""
        z = self._check(z if z.ndim == 5 else z.unsqueeze(2))
        for frame in z.split(1, dim=2):
            yield self._decode_clip(frame, timer, options)


# --- checkpoints ----------------------------------------------------------------


def config_from_diffusers(cfg: dict[str, Any]) -> dict[str, Any]:
    """Our config from an ``AutoencoderKLMiniMaxH3`` ``config.json``."""
    out = {k: cfg[k] for k in DEFAULTS if k in cfg}
    out["patch_size"] = math.prod(cfg.get("spatial_downsample_factors", (2, 2, 2, 2, 1, 1)))
    out["patch_size_t"] = math.prod(cfg.get("temporal_downsample_factors", (1, 2, 2, 1, 1, 1)))
    return {**DEFAULTS, **out}


def config_from_original(cfg: dict[str, Any], ffn_mult: int) -> dict[str, Any]:
    """Our config from the original ``vvae`` config keys (the seed's defaults)."""
    dim, heads = int(cfg.get("dim", 2048)), int(cfg.get("heads", 32))
    return {
        **DEFAULTS,
        "latent_channels": int(cfg.get("z_channels", 24)),
        "patch_size": int(cfg.get("patch_size", 16)),
        "patch_size_t": int(cfg.get("patch_size_t", 4)),
        "decoder_num_layers": int(cfg.get("num_layers", 36)),
        "decoder_num_attention_heads": heads,
        "decoder_attention_head_dim": dim // heads,
        "decoder_num_register_tokens": int(cfg.get("num_register_tokens", 4)),
        "decoder_ffn_mult": ffn_mult,
        "decoder_rope_theta": float(cfg.get("rope_theta", 100.0)),
        "decoder_rope_dim_ratio": float(cfg.get("rope_dim_ratio", 0.75)),
        "decoder_rope_axes": min(max(int(cfg.get("rope_dims", 3)), 2), 3),
        "decoder_norm_eps": float(cfg.get("eps", 1e-5)),
    }


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(config, decoder state dict)`` from a diffusers folder (``vae/`` or a
    pipeline root) or an original single file with ``vvae.*`` names."""
    source = Path(source)
    if source.is_dir() and (source / "vae" / "config.json").exists():
        source = source / "vae"
    files = _weight_files(source) if source.is_dir() else [source]
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(f))
    folder = source if source.is_dir() else source.parent
    if any(k.startswith("vvae.") for k in state):
        return _convert_original(state, folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} is needed beside diffusers-layout weights")
    config = config_from_diffusers(json.loads(config_path.read_text()))
    keep = ("decoder.", "post_quant_conv.")
    return config, {k: v for k, v in state.items() if k.startswith(keep)}


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors of a folder: the shard index, the default file, or all."""
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.exists():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        return [folder / s for s in sorted(shards)]
    if (folder / "diffusion_pytorch_model.safetensors").exists():
        return [folder / "diffusion_pytorch_model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors under {folder}")
    return files


_ORIGINAL_NAMES = {
    "post_quant_conv.weight": "post_quant_conv.weight",
    "post_quant_conv.bias": "post_quant_conv.bias",
    "x_embedder.weight": "decoder.proj_in.weight",
    "x_embedder.bias": "decoder.proj_in.bias",
    "register_tokens": "decoder.register_tokens",
    "norm_out.weight": "decoder.norm_out.weight",
    "norm_out.bias": "decoder.norm_out.bias",
    "proj_out.weight": "decoder.proj_out.weight",
    "proj_out.bias": "decoder.proj_out.bias",
}
_ORIGINAL_BLOCK_NAMES = {
    "norm1": "norm1.weight",
    "norm1.weight": "norm1.weight",
    "norm2": "norm2.weight",
    "norm2.weight": "norm2.weight",
    "scale1": "scale1",
    "scale2": "scale2",
    "attn.to_out.weight": "attn.to_out.0.weight",
    "attn.to_out.bias": "attn.to_out.0.bias",
    "ff.w2.weight": "ff.net.2.weight",
    "ff.w2.bias": "ff.net.2.bias",
}


def _convert_original(state: dict[str, Tensor], folder: Path) -> tuple[dict, dict[str, Tensor]]:
    """The seed's fused layout: per-head interleaved ``to_qkv``, ``[gate; value]`` ``w1``."""
    vvae = {k.removeprefix("vvae."): v for k, v in state.items() if k.startswith("vvae.")}
    if "config_json" in vvae:
        raw = json.loads(vvae.pop("config_json").to(torch.uint8).numpy().tobytes().decode())
    elif (folder / "config.json").exists():
        raw = json.loads((folder / "config.json").read_text())
    else:
        raise FileNotFoundError("no vvae.config_json tensor and no config.json beside it")
    dim = vvae["x_embedder.weight"].shape[0]
    config = config_from_original(raw, vvae["blocks.0.ff.w1.weight"].shape[0] // (2 * dim))
    heads = config["decoder_num_attention_heads"]
    for stat in ("latents_mean", "latents_std"):
        if stat in vvae:
            config[stat] = vvae.pop(stat).float().flatten().tolist()

    out: dict[str, Tensor] = {}
    for name, value in vvae.items():
        if name in _ORIGINAL_NAMES:
            out[_ORIGINAL_NAMES[name]] = value
        elif name.startswith("blocks."):
            out.update(_convert_block_tensor(name, value, heads))
        # anything else (enc.*, quant_conv.*) is the encoder half: not ours
    c = config["latent_channels"]
    out["post_quant_conv.weight"] = out["post_quant_conv.weight"].reshape(c, c, 1, 1, 1)
    out["decoder.proj_in.weight"] = out["decoder.proj_in.weight"].reshape(dim, c)
    out["decoder.register_tokens"] = out["decoder.register_tokens"].reshape(1, -1, dim)
    return config, out


def _convert_block_tensor(name: str, value: Tensor, heads: int) -> dict[str, Tensor]:
    _, index, rest = name.split(".", 2)
    prefix = f"decoder.transformer_blocks.{index}."
    if rest in _ORIGINAL_BLOCK_NAMES:
        target = _ORIGINAL_BLOCK_NAMES[rest]
        return {prefix + target: value.flatten() if target.startswith("scale") else value}
    if rest.startswith("attn.to_qkv."):
        # rows are [head0: q k v, head1: q k v, ...]
        kind = rest.rsplit(".", 1)[1]
        q, k, v = value.unflatten(0, (heads, 3, -1)).unbind(1)
        return {
            f"{prefix}attn.to_{n}.{kind}": t.flatten(0, 1).contiguous()
            for n, t in zip("qkv", (q, k, v), strict=True)
        }
    if rest.startswith("ff.w1."):
        gate, val = value.chunk(2, dim=0)
        return {f"{prefix}ff.net.0.proj.{rest.rsplit('.', 1)[1]}": torch.cat((val, gate))}
    raise KeyError(f"unexpected tensor vvae.{name} in an original MiniMax-H3 VAE file")


# --- synthetic defaults -----------------------------------------------------------

SYNTHETIC: dict[str, dict[str, Any]] = {
    "minimax-h3-tiny": {
        **DEFAULTS,
        "decoder_num_layers": 2,
        "decoder_num_attention_heads": 2,
        "decoder_attention_head_dim": 16,
        "latents_mean": [round(0.1 * math.sin(i), 4) for i in range(24)],
        "latents_std": [round(1.0 + 0.2 * math.cos(i), 4) for i in range(24)],
    },
    # MiniMax-H3-Image: one frame per latent frame, RoPE over (h, w) only
    "minimax-h3-image-tiny": {
        **DEFAULTS,
        "patch_size_t": 1,
        "decoder_rope_axes": 2,
        "decoder_num_layers": 2,
        "decoder_num_attention_heads": 2,
        "decoder_attention_head_dim": 16,
        "latents_mean": [round(0.1 * math.cos(i), 4) for i in range(24)],
        "latents_std": [round(1.0 + 0.2 * math.sin(i), 4) for i in range(24)],
    },
}


@torch.no_grad()
def init_synthetic(decoder: Decoder, generator: torch.Generator) -> None:
    """Deterministic weights shaped like trained ones: unit-ish norms, fan-in
    scaled linears and small layer scales, so residual branches add small
    corrections (random default init would fail a bf16 parity gate)."""
    for name, p in sorted(decoder.named_parameters()):
        noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
        if name.endswith(("norm1.weight", "norm2.weight", "norm_out.weight")):
            value = 1.0 + 0.05 * noise
        elif name.endswith(("scale1", "scale2")):
            value = 0.05 + 0.02 * noise
        elif name.endswith("bias"):
            value = 0.02 * noise
        elif name.endswith("register_tokens"):
            value = 0.5 * noise
        else:
            value = noise / math.sqrt(p[0].numel())
        p.copy_(value)
