"""The HunyuanVideo causal 3-D VAE decoder (diffusers' ``AutoencoderKLHunyuanVideo``).

latent [B,16,T,H,W] -> post_quant_conv -> conv_in -> mid (resnet, causal attention, resnet)
-> up blocks (resnets, then an upsampler: nearest 2x in space [and time] + causal conv)
-> GroupNorm -> SiLU -> conv_out -> RGB [B,3,1+4(T-1),8H,8W] in [-1, 1] (unclamped)

Every 3-D conv is causal with REPLICATE padding: the input is preceded by two copies of its
first frame and its borders in H and W are repeated (not zero-padded). Nothing here is
frame-local: GroupNorm statistics span T x H x W of the whole input, and the mid-block
attention (one head over every pixel of every frame) lets a pixel of frame f see every pixel
of frames 0..f. So one forward pass is one indivisible unit; the reference cuts long clips
into overlapping windows of latent frames and blends them (``tiling.py``, run by
``decode.py``), and the service streams window by window.

Time: an upsampler with a temporal factor passes the input's first frame through once and
doubles every later one (nearest), so T latent frames make 1 + 2(T-1) frames per temporal
upsampler; HunyuanVideo has two (blocks 1 and 2 of 4), hence 1 + 4(T-1).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.families.ops import conv3d

EPS = 1e-6  # every GroupNorm of the decoder


# --- layers -------------------------------------------------------------------------------
class ReplicateCausalConv3d(nn.Module):
    """Conv3d after replicate padding: ``k - 1`` copies of the first frame before the clip,
    ``k // 2`` repeated border pixels on each side in H and W."""

    def __init__(self, cin: int, cout: int, kernel: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, kernel)
        half = kernel // 2
        self.padding = (half, half, half, half, kernel - 1, 0)  # (W, W, H, H, T before, T after)

    def forward(self, x: Tensor) -> Tensor:
        if any(self.padding):
            x = F.pad(x, self.padding, mode="replicate")
        return conv3d(x, self.conv)


class ResnetBlock(nn.Module):
    """x' = shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))."""

    def __init__(self, cin: int, cout: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=EPS)
        self.conv1 = ReplicateCausalConv3d(cin, cout)
        self.norm2 = nn.GroupNorm(groups, cout, eps=EPS)
        self.conv2 = ReplicateCausalConv3d(cout, cout)
        self.conv_shortcut = ReplicateCausalConv3d(cin, cout, 1) if cin != cout else None

    def forward(self, x: Tensor) -> Tensor:
        skip = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + skip


class CausalAttention(nn.Module):
    """One head over all T*H*W pixels, residual; a pixel of frame f attends to the pixels of
    frames 0..f (the reference's block-causal mask). Computed one query frame at a time
    against the keys of the frames it may see, so no (THW)^2 mask is ever built: the masked
    scores would be exp(-inf) = 0 exactly."""

    def __init__(self, dim: int, groups: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, dim, eps=EPS)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        tokens = self.group_norm(x).flatten(2).transpose(1, 2)  # [B, T*H*W, C], (t, h, w) order
        q, k, v = (proj(tokens).unsqueeze(1) for proj in (self.to_q, self.to_k, self.to_v))
        n = h * w
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    q[:, :, f * n : (f + 1) * n], k[:, :, : (f + 1) * n], v[:, :, : (f + 1) * n]
                )
                for f in range(t)
            ],
            dim=2,
        )
        out = self.to_out[0](out.squeeze(1))
        return x + out.transpose(1, 2).reshape(b, c, t, h, w)


class Upsampler(nn.Module):
    """Nearest upsampling by ``(ft, fs, fs)``, except that the first frame is not repeated in
    time, then a causal 3x3x3 conv."""

    def __init__(self, dim: int, temporal: bool, spatial: bool) -> None:
        super().__init__()
        self.conv = ReplicateCausalConv3d(dim, dim)
        self.factor_t, self.factor_s = (2 if temporal else 1), (2 if spatial else 1)

    def forward(self, x: Tensor) -> Tensor:
        if self.factor_t > 1 and x.shape[2] > 1:
            repeats = torch.full((x.shape[2],), self.factor_t, device=x.device)
            repeats[0] = 1
            x = x.repeat_interleave(
                repeats, dim=2, output_size=1 + self.factor_t * (x.shape[2] - 1)
            )
        if self.factor_s > 1:
            x = x.repeat_interleave(self.factor_s, dim=-2).repeat_interleave(self.factor_s, dim=-1)
        return self.conv(x)


class MidBlock(nn.Module):
    def __init__(self, dim: int, groups: int, attention: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(dim, dim, groups), ResnetBlock(dim, dim, groups)])
        self.attentions = nn.ModuleList([CausalAttention(dim, groups)] if attention else [])

    def forward(self, x: Tensor) -> Tensor:
        x = self.resnets[0](x)
        for attention in self.attentions:
            x = attention(x)
        return self.resnets[1](x)


class UpBlock(nn.Module):
    def __init__(
        self, cin: int, cout: int, layers: int, groups: int, temporal: bool, spatial: bool
    ) -> None:
        super().__init__()
        dims = [cin] + [cout] * layers
        self.resnets = nn.ModuleList(
            ResnetBlock(a, b, groups) for a, b in zip(dims[:-1], dims[1:], strict=True)
        )
        self.upsamplers = None
        if temporal or spatial:
            self.upsamplers = nn.ModuleList([Upsampler(cout, temporal, spatial)])

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return self.upsamplers[0](x) if self.upsamplers is not None else x


def up_factors(blocks: int, spatial_ratio: int, temporal_ratio: int) -> list[tuple[bool, bool]]:
    """(temporal, spatial) upsampling of each up block, as HunyuanVideo places them: space in
    the first log2(spatial) blocks, time in the two blocks before the last."""
    if temporal_ratio != 4:
        raise ValueError(f"temporal compression {temporal_ratio}: HunyuanVideo decodes only 4")
    spatial_ups, temporal_ups = int(math.log2(spatial_ratio)), int(math.log2(temporal_ratio))
    return [(blocks - 1 - temporal_ups <= i < blocks - 1, i < spatial_ups) for i in range(blocks)]


# --- the architecture ----------------------------------------------------------------------
class Architecture(nn.Module):
    """The decoder network (``config``: diffusers' ``AutoencoderKLHunyuanVideo`` names, see
    ``convert.py``); ``forward`` is one pass over a whole latent clip (no windows, no tiles)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        z, groups = config["latent_channels"], config["norm_num_groups"]
        widths = list(reversed(config["block_out_channels"]))
        layers = config["layers_per_block"] + 1
        factors = up_factors(
            len(widths), config["spatial_compression_ratio"], config["temporal_compression_ratio"]
        )
        self.post_quant_conv = nn.Conv3d(z, z, 1)
        self.conv_in = ReplicateCausalConv3d(z, widths[0])
        self.mid_block = MidBlock(widths[0], groups, config.get("mid_block_add_attention", True))
        self.up_blocks = nn.ModuleList(
            UpBlock(cin, cout, layers, groups, temporal, spatial)
            for cin, cout, (temporal, spatial) in zip(
                [widths[0], *widths[:-1]], widths, factors, strict=True
            )
        )
        self.conv_norm_out = nn.GroupNorm(groups, widths[-1], eps=EPS)
        self.conv_act = nn.SiLU()
        self.conv_out = ReplicateCausalConv3d(widths[-1], config.get("out_channels", 3))
        self._spatial = 2 ** sum(s for _, s in factors)
        self._temporal = 2 ** sum(t for t, _ in factors)

    def forward(self, z: Tensor) -> Tensor:
        x = self.conv_in(self.post_quant_conv(z))
        x = self.mid_block(x)
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(self.conv_act(self.conv_norm_out(x)))
