"""MiniMax-H3's ViT3D VAE decoder (video) and its image variant, exactly.

Every latent cell is one token; a stack of pre-norm transformer blocks (RMSNorm,
weightless q/k RMSNorm, RoPE on the first ``rope_dim_ratio`` of each head,
SwiGLU, layer scales) runs over a tile's tokens plus learned register tokens and
one all-zero token, and a LayerNorm + linear head expands each cell into a
``patch_t x patch x patch`` RGB block (ImageNet-normalized).

``Architecture.forward`` decodes one tile clip. ``decode.py``'s ``decode`` / ``iter_decode``
run the reference's 256-px spatial tiles and 17-frame temporal clips over it
(``schedule.py``): that tiling is part of the model's output, not a memory strategy.

State-dict names are diffusers' (``AutoencoderKLMiniMaxH3``) decoder half.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
FP32_SUFFIXES = (
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


# --- the architecture ---------------------------------------------------------


class Architecture(nn.Module):
    """The decoder network; ``forward`` decodes one tile clip ``[B,C,t,h,w]`` ->
    ``[B,3,t*pt,h*p,w*p]``, untiled."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        cfg = {**DEFAULTS, **config}
        c = cfg["latent_channels"]
        cfg["latents_mean"] = [float(v) for v in (cfg["latents_mean"] or [0.0] * c)]
        cfg["latents_std"] = [float(v) for v in (cfg["latents_std"] or [1.0] * c)]
        self.config = cfg
        self.post_quant_conv = nn.Conv3d(c, c, kernel_size=1)
        self.decoder = ViTDecoder(cfg)
        self.unpatchify = Unpatchify(cfg["patch_size_t"], cfg["patch_size"])
        self._rope_cache: dict[tuple[Any, ...], Rope] = {}

    def forward(self, z: Tensor) -> Tensor:
        b, c, t, h, w = z.shape
        # the 1x1x1 conv as a conv (not a linear): the same rounding as the reference in bf16
        tokens = self.post_quant_conv(z).permute(0, 2, 3, 4, 1).reshape(b, t * h * w, c)
        x = self.decoder(tokens, self.rope((t, h, w), z.device))
        return self.unpatchify(x, (t, h, w))

    def rope(self, grid: tuple[int, int, int], device: torch.device) -> Rope:
        """The RoPE tables of a ``(t, h, w)`` token grid (cached per grid and device)."""
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
