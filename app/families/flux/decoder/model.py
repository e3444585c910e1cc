"""The FLUX-family decoder, exactly: every diffusers ``AutoencoderKL`` decoder, and FLUX.2's.

latent -> [post_quant_conv] -> conv_in -> mid (resnet, attention, resnet)
       -> up blocks (resnets, nearest 2x + conv) -> GroupNorm + SiLU -> conv_out -> RGB in [-1, 1]

One architecture covers FLUX.1 (16 ch, no post-quant conv), SD3 (16 ch), SDXL / SD1.5
(4 ch, post-quant conv) and FLUX.2 (32 ch, post-quant conv, latent BatchNorm statistics over
the 2x2 patch layout). Parameter names follow diffusers' (minus the ``decoder.`` prefix), so a
diffusers checkpoint loads by renaming nothing (``convert.py`` maps the BFL/LDM layout).

This file is the float32 source of truth: the layers and ``Architecture.forward``.
``decode.py`` serves it (``Decoder``: geometry, de-normalization, row bands, the memory
estimate); ``fast.py`` holds the rewrites ``optimize`` swaps in behind the gate.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GN_EPS = 1e-6

FLUX1_CONFIG: dict[str, Any] = {
    "latent_channels": 16,
    "out_channels": 3,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "mid_block_add_attention": True,
    "use_post_quant_conv": False,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "latent_bn": False,
}


class ResnetBlock(nn.Module):
    """x + conv2(silu(norm2(conv1(silu(norm1(x)))))), 1x1 shortcut when widths differ."""

    def __init__(self, cin: int, cout: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=GN_EPS)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout, eps=GN_EPS)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None
        self.nonlinearity = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(self.nonlinearity(self.norm1(x)))
        h = self.conv2(self.nonlinearity(self.norm2(h)))
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return skip + h


class SpatialAttention(nn.Module):
    """Single-head self-attention over all H*W positions, residual."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=GN_EPS)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        tokens = self.group_norm(x).flatten(2).transpose(1, 2)  # [B, HW, C]
        q, k, v = (proj(tokens).unsqueeze(1) for proj in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1)
        out = self.to_out[0](out).transpose(1, 2).reshape(b, c, h, w)
        return x + out


class MidBlock(nn.Module):
    def __init__(self, channels: int, groups: int, attention: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels, channels, groups) for _ in range(2)])
        self.attentions = nn.ModuleList([SpatialAttention(channels, groups)] if attention else [])

    def forward(self, x: Tensor) -> Tensor:
        x = self.resnets[0](x)
        for attn in self.attentions:
            x = attn(x)
        return self.resnets[1](x)


class Upsample(nn.Module):
    """Nearest 2x, then a 3x3 conv."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, n_resnets: int, groups: int, upsample: bool) -> None:
        super().__init__()
        widths = [cin] + [cout] * n_resnets
        self.resnets = nn.ModuleList(
            ResnetBlock(widths[i], widths[i + 1], groups) for i in range(n_resnets)
        )
        self.upsamplers = nn.ModuleList([Upsample(cout)] if upsample else [])

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        for up in self.upsamplers:
            x = up(x)
        return x


class LatentStats(nn.Module):
    """FLUX.2's BatchNorm running statistics over the 2x2-patchified latent (buffers only)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))


class Architecture(nn.Module):
    """The decoder network: ``forward`` maps a (de-normalized) latent to RGB in [-1, 1]."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = cfg = {**FLUX1_CONFIG, **config}
        widths = list(reversed(cfg["block_out_channels"]))
        groups, latent = cfg["norm_num_groups"], cfg["latent_channels"]
        self.post_quant_conv = nn.Conv2d(latent, latent, 1) if cfg["use_post_quant_conv"] else None
        self.conv_in = nn.Conv2d(latent, widths[0], 3, padding=1)
        self.mid_block = MidBlock(widths[0], groups, cfg["mid_block_add_attention"])
        self.up_blocks = nn.ModuleList(
            UpBlock(
                widths[max(i - 1, 0)],
                widths[i],
                cfg["layers_per_block"] + 1,
                groups,
                upsample=i < len(widths) - 1,
            )
            for i in range(len(widths))
        )
        self.conv_norm_out = nn.GroupNorm(groups, widths[-1], eps=GN_EPS)
        self.conv_act = nn.SiLU()
        self.conv_out = nn.Conv2d(widths[-1], cfg["out_channels"], 3, padding=1)
        self.bn = LatentStats(4 * latent) if cfg["latent_bn"] else None

    def forward(self, z: Tensor) -> Tensor:
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        x = self.conv_in(z)
        x = self.mid_block(x)
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(self.conv_act(self.conv_norm_out(x)))
