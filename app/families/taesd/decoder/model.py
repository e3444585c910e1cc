"""TAESD family: madebyollin's tiny preview decoders (TAESD, TAEF1, TAEF2).

A stack of conv/ReLU residual blocks and nearest 2x upsamples, ~1.2 M parameters,
that decodes a diffusion model's latent straight to RGB in about [0, 1]. Built for
live previews: a sampler decodes every step with it instead of the full VAE.

Layout for ``channels = [c0, c1, ..., cn]`` and ``blocks = [b0, b1, ..., bn]``::

    clamp     tanh(z / 3) * 3
    conv_in   3x3 conv latent -> c0, ReLU
    mid       b0 blocks at c0 (latent resolution); TAEF2 adds a GroupNorm "pool"
              branch to each of them
    up_i      nearest 2x upsample, 3x3 conv c_i -> c_{i+1} (no bias), b_{i+1} blocks
    conv_out  3x3 conv cn -> 3 (RGB, not clamped, like the reference)

The latent is decoded as the diffusion model emits it: no scale or shift (TAEF2 takes
FLUX.2's BatchNorm-normalized, unpatchified 32-channel latent at 8x).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Label -> the latent channels of that variant; TAEF2 is also told apart by its pool branch.
VARIANT_CHANNELS = {"taesd": 4, "taef1": 16, "taef2": 32}
DEFAULTS: dict[str, Any] = {
    "channels": [64, 64, 64, 64],
    "blocks": [3, 3, 3, 1],
    # TAEF2's mid-block pool: 1x1 conv c0 -> 4*c0, GroupNorm, ReLU, 1x1 conv back.
    "mid_pool_channels": 0,
    # Not visible in the weights' shapes; 4 is upstream's value (checked by the
    # real-photo round trip: other group counts lose several dB).
    "mid_pool_groups": 4,
}


def conv3(c_in: int, c_out: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, padding=1, bias=bias)


def conv1(c_in: int, c_out: int) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 1, bias=False)


class Clamp(nn.Module):
    """Soft clamp of the latent to about [-3, 3]: tanh(z / 3) * 3."""

    def forward(self, z: Tensor) -> Tensor:
        return torch.tanh(z / 3) * 3


class Block(nn.Module):
    """conv/ReLU/conv/ReLU/conv plus a skip, then ReLU; optionally a pool branch first."""

    def __init__(self, c_in: int, c_out: int, pool_channels: int = 0, pool_groups: int = 4):
        super().__init__()
        self.pool: nn.Sequential | None = None
        if pool_channels:
            self.pool = nn.Sequential(
                conv1(c_in, pool_channels),
                nn.GroupNorm(pool_groups, pool_channels),
                nn.ReLU(),
                conv1(pool_channels, c_in),
            )
        self.conv = nn.Sequential(
            conv3(c_in, c_out), nn.ReLU(), conv3(c_out, c_out), nn.ReLU(), conv3(c_out, c_out)
        )
        self.skip: nn.Module = conv1(c_in, c_out) if c_in != c_out else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        if self.pool is not None:
            x = x + self.pool(x)
        return F.relu(self.conv(x) + self.skip(x))


class UpStage(nn.Module):
    """Nearest 2x upsample, a bias-free conv, then blocks."""

    def __init__(self, c_in: int, c_out: int, n_blocks: int):
        super().__init__()
        self.upsample = nn.Upsample(scale_factor=2.0, mode="nearest")
        self.conv = conv3(c_in, c_out, bias=False)
        self.blocks = nn.Sequential(*(Block(c_out, c_out) for _ in range(n_blocks)))

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(self.conv(self.upsample(x)))


def normalize_config(config: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults and check the geometry; a bad config fails here, not mid-decode."""
    variant = config.get("variant", "taesd")
    if variant not in VARIANT_CHANNELS:
        raise ValueError(
            f"taesd: unknown variant {variant!r}; known: {', '.join(VARIANT_CHANNELS)}"
        )
    cfg = {**DEFAULTS, "latent_channels": VARIANT_CHANNELS[variant], **config, "variant": variant}
    if variant == "taef2" and "mid_pool_channels" not in config:
        cfg["mid_pool_channels"] = 4 * cfg["channels"][0]
    cfg["channels"], cfg["blocks"] = list(cfg["channels"]), list(cfg["blocks"])
    if len(cfg["channels"]) != len(cfg["blocks"]) or len(cfg["channels"]) < 1:
        raise ValueError("taesd: 'channels' and 'blocks' need one entry per stage (mid + each up)")
    pool = cfg["mid_pool_channels"]
    if pool and pool % cfg["mid_pool_groups"]:
        raise ValueError("taesd: mid_pool_channels must be a multiple of mid_pool_groups")
    return cfg


class Architecture(nn.Module):
    """The decoder network; ``forward`` returns RGB in about [0, 1], unclamped."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = cfg = normalize_config(config)
        ch, blocks = cfg["channels"], cfg["blocks"]
        self.clamp = Clamp()
        self.conv_in = conv3(cfg["latent_channels"], ch[0])
        self.act_in = nn.ReLU()
        pool = (cfg["mid_pool_channels"], cfg["mid_pool_groups"])
        self.mid = nn.Sequential(*(Block(ch[0], ch[0], *pool) for _ in range(blocks[0])))
        self.up = nn.ModuleList(
            UpStage(ch[i], ch[i + 1], blocks[i + 1]) for i in range(len(ch) - 1)
        )
        self.conv_out = conv3(ch[-1], 3)

    def forward(self, z: Tensor) -> Tensor:
        x = self.act_in(self.conv_in(self.clamp(z)))
        x = self.mid(x)
        for stage in self.up:
            x = stage(x)
        return self.conv_out(x)
