"""MiniMax-H3's ViT3D VAE decoder (video) and its image variant, exactly.

Every latent cell is one token; a stack of pre-norm transformer blocks (RMSNorm,
weightless q/k RMSNorm, RoPE on the first ``rope_dim_ratio`` of each head,
SwiGLU, layer scales) runs over a tile's tokens plus learned register tokens and
one all-zero token, and a LayerNorm + linear head expands each cell into a
``patch_t x patch x patch`` RGB block (ImageNet-normalized).

``Decoder.forward`` decodes one tile clip. ``decode`` / ``iter_decode`` run the reference's
256-px spatial tiles and 17-frame temporal clips over it (``schedule.py``): that tiling is
part of the model's output, not a memory strategy.

State-dict names are diffusers' (``AutoencoderKLMiniMaxH3``) decoder half.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app import timing
from app.decoders.base import VAEDecoder
from app.decoders.minimax_h3 import fast
from app.decoders.minimax_h3.schedule import (
    TILE,
    ClipPlan,
    clip_plan,
    crossfade,
    split_tiles,
    stitch_tiles,
)

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

Rope = tuple[Tensor, Tensor]  # cos, sin: [tokens, 1, rope_dim]


# --- layers -----------------------------------------------------------------


def rope_tables(
    grid: tuple[int, ...], extra: int, rope_dim: int, theta: float, device: torch.device
) -> Rope:
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


def rotate(x: Tensor, rope: Rope) -> Tensor:
    """Rotate-half RoPE on the first ``rope_dim`` channels of ``x [..., N, H, D]``."""
    cos, sin = (t.to(x.dtype) for t in rope)
    r = cos.shape[-1]
    head, rest = x[..., :r], x[..., r:]
    lo, hi = head.chunk(2, dim=-1)
    turned = torch.cat((-hi, lo), dim=-1)
    return torch.cat((head * cos + turned * sin, rest), dim=-1)


class RMSNorm(nn.RMSNorm):
    """RMSNorm computed in float32 (the reference's), returning float32."""

    def forward(self, x: Tensor) -> Tensor:
        weight = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), self.normalized_shape, weight, self.eps)


class DotProductAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v over heads: ``[B, N, H, D]`` in and out."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.qk_norm = RMSNorm(head_dim, eps=eps, elementwise_affine=False)
        self.attend = DotProductAttention()
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])  # diffusers' name: to_out.0

    def forward(self, x: Tensor, rope: Rope) -> Tensor:
        b, n, _ = x.shape
        q, k, v = (
            proj(x).view(b, n, self.heads, self.head_dim)
            for proj in (self.to_q, self.to_k, self.to_v)
        )
        q, k = (rotate(self.qk_norm(t).to(t.dtype), rope) for t in (q, k))
        return self.to_out[0](self.attend(q, k, v).reshape(b, n, -1))


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
    """Pre-norm transformer block with layer scales. ``x`` is the float32 residual stream;
    the branches run in the linears' dtype."""

    def __init__(self, dim: int, heads: int, head_dim: int, mult: int, eps: float) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim, eps=eps)
        self.attn = Attention(dim, heads, head_dim, eps)
        self.scale1 = nn.Parameter(torch.zeros(dim))
        self.norm2 = RMSNorm(dim, eps=eps)
        self.ff = FeedForward(dim, mult)
        self.scale2 = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor, rope: Rope) -> Tensor:
        dtype = self.attn.to_q.weight.dtype
        x = x + self.attn(self.norm1(x).to(dtype), rope) * self.scale1.float()
        return x + self.ff(self.norm2(x).to(dtype)) * self.scale2.float()


class Blocks(nn.ModuleList):
    """The transformer blocks, run in order (a list: diffusers' ``transformer_blocks.N``)."""

    def forward(self, x: Tensor, rope: Rope) -> Tensor:
        for block in self:
            x = block(x, rope)
        return x


class ViTDecoder(nn.Module):
    """Tokens ``[B, cells, C]`` -> per-cell pixel patches ``[B, cells, 3*pt*p*p]``."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        heads, head_dim = cfg["decoder_num_attention_heads"], cfg["decoder_attention_head_dim"]
        dim = heads * head_dim
        pixels = cfg["out_channels"] * cfg["patch_size_t"] * cfg["patch_size"] ** 2
        self.proj_in = nn.Linear(cfg["latent_channels"], dim)
        self.register_tokens = nn.Parameter(torch.zeros(1, cfg["decoder_num_register_tokens"], dim))
        self.transformer_blocks = Blocks(
            Block(dim, heads, head_dim, cfg["decoder_ffn_mult"], cfg["decoder_norm_eps"])
            for _ in range(cfg["decoder_num_layers"])
        )
        self.norm_out = nn.LayerNorm(dim, eps=cfg["decoder_norm_eps"])
        self.proj_out = nn.Linear(dim, pixels)

    def forward(self, tokens: Tensor, rope: Rope) -> Tensor:
        b, cells, _ = tokens.shape
        x = self.proj_in(tokens)
        registers = self.register_tokens.to(x.dtype).expand(b, -1, -1)
        # the residual stream is float32, as the reference's layer scales make it
        x = torch.cat((x, registers, x.new_zeros(b, 1, x.shape[-1])), dim=1).float()
        x = self.transformer_blocks(x, rope)
        # norm and projection are per token: drop the suffix tokens first
        x = self.norm_out(x[:, :cells]).to(self.proj_out.weight.dtype)
        return self.proj_out(x)


class Unpatchify(nn.Module):
    """``[B, t*h*w, 3*pt*p*p]`` -> ``[B, 3, t*pt, h*p, w*p]``."""

    def __init__(self, patch_t: int, patch: int) -> None:
        super().__init__()
        self.patch_t, self.patch = patch_t, patch

    def forward(self, x: Tensor, grid: tuple[int, int, int]) -> Tensor:
        (t, h, w), pt, p = grid, self.patch_t, self.patch
        x = x.view(x.shape[0], t, h, w, -1, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(x.shape[0], x.shape[1], t * pt, h * p, w * p)


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
        self.unpatchify = Unpatchify(cfg["patch_size_t"], cfg["patch_size"])
        self._rope_cache: dict[tuple[Any, ...], Rope] = {}

    def forward(self, z: Tensor) -> Tensor:
        """One tile clip: ``[B,C,t,h,w]`` -> ``[B,3,t*pt,h*p,w*p]``, untiled."""
        b, c, t, h, w = z.shape
        # the 1x1x1 conv as a conv (not a linear): the same rounding as the reference in bf16
        tokens = self.post_quant_conv(z).permute(0, 2, 3, 4, 1).reshape(b, t * h * w, c)
        x = self.decoder(tokens, self._rope((t, h, w), z.device))
        return self.unpatchify(x, (t, h, w))

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

    def stages(self) -> list[tuple[str, nn.Module]]:
        vit = self.decoder
        return [
            ("embed", self.post_quant_conv),
            ("embed", vit.proj_in),
            ("blocks", vit.transformer_blocks),
            ("head", vit.norm_out),
            ("head", vit.proj_out),
            ("unpatchify", self.unpatchify),
        ]

    def fine_stages(self) -> list[tuple[str, nn.Module]]:
        """Inside the blocks, for profiling: ``norm``, ``qkv``, ``attention``, ``out``, ``ffn``
        (instrument these beside ``stages()``; ``blocks`` then holds their sum)."""
        found: list[tuple[str, nn.Module]] = []
        for block in self.decoder.transformer_blocks:
            a = block.attn
            found += [("norm", block.norm1), ("norm", block.norm2), ("ffn", block.ff)]
            found += [("qkv", m) for m in (a.to_q, a.to_k, a.to_v, a.qk_norm)]
            found += [("attention", a.attend), ("out", a.to_out[0])]
        return found

    def keeps_float32(self, name: str) -> bool:
        # the norms and layer scales, as the reference pins them (``_apply`` below)
        return name.endswith(_FP32_SUFFIXES)

    def optimize(self) -> None:
        fast.optimize(self)

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

    # --- decoding: the reference's tiles and clips over ``forward`` --------
    def decode(self, z: Tensor, **options: Any) -> Tensor:
        return torch.cat(list(self.iter_decode(z, **options)), dim=2)

    def iter_decode(self, z: Tensor, **options: Any) -> Iterator[Tensor]:
        """Yield ``[B,3,t,H,W]`` frame chunks in order, as each clip is decoded.

        ``options``: ``max_batch_tokens`` (tiles batched per ``forward`` call).
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
            yield emit(self._decode_clip(z, options)[:, :, plan.pre_pad :])
            return
        carry: Tensor | None = None
        cf = plan.chunk_frames
        for start, stop in plan.clips:
            clip = self._decode_clip(z[:, :, start:stop], options)
            with timing.phase("chunk_blend"), torch.no_grad():
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
    def _decode_clip(self, z: Tensor, options: dict[str, Any]) -> Tensor:
        """One temporal clip ``[B,C,t,h,w]``, spatially tiled and blended."""
        r = self.spatial_scale
        height, width = z.shape[-2] * r, z.shape[-1] * r
        ys, yl, yo = split_tiles(height, r)
        xs, xl, xo = split_tiles(width, r)
        th, tw = yl[0] // r, xl[0] // r
        # every tile has the same shape: decode them as one batch of sequences
        subs = [z[..., y // r : y // r + th, x // r : x // r + tw] for y in ys for x in xs]
        out = self._decode_tiles(torch.cat(subs), options)
        grid = out.unflatten(0, (len(ys), len(xs), z.shape[0]))
        tiles = [[grid[i, j] for j in range(len(xs))] for i in range(len(ys))]
        with timing.phase("tile_blend"):
            if len(ys) * len(xs) == 1:
                return tiles[0][0]
            return stitch_tiles(tiles, (ys, xs), (yo, xo), (height, width))

    def _decode_tiles(self, z: Tensor, options: dict[str, Any]) -> Tensor:
        """``[S,C,t,h,w]`` independent tiles -> ``[S,3,t*pt,h*p,w*p]``, in groups."""
        _, _, t, h, w = z.shape
        tokens = t * h * w + self.decoder.register_tokens.shape[1] + 1
        budget = int(options.get("max_batch_tokens") or DEFAULT_BATCH_TOKENS)
        parts = [self(part) for part in z.split(max(1, budget // tokens))]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _rope(self, grid: tuple[int, int, int], device: torch.device) -> Rope:
        axes = int(self.config["decoder_rope_axes"])
        key = (grid, str(device))
        if key not in self._rope_cache:
            cfg = self.config
            rope_dim = int(cfg["decoder_attention_head_dim"] * cfg["decoder_rope_dim_ratio"])
            extra = cfg["decoder_num_register_tokens"] + 1
            self._rope_cache[key] = rope_tables(
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

    def decode(self, z: Tensor, **options: Any) -> Tensor:
        if z.ndim == 4:
            return self._decode_clip(self._check(z.unsqueeze(2)), options).squeeze(2)
        return torch.cat(list(self.iter_decode(z, **options)), dim=2)

    def iter_decode(self, z: Tensor, **options: Any) -> Iterator[Tensor]:
        """One ``[B,3,1,H,W]`` chunk per latent frame."""
        z = self._check(z if z.ndim == 5 else z.unsqueeze(2))
        for frame in z.split(1, dim=2):
            yield self._decode_clip(frame, options)
