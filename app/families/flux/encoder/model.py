"""The FLUX-family encoder, exactly: every diffusers ``AutoencoderKL`` encoder, and FLUX.2's.

RGB in [-1, 1] -> conv_in -> down blocks (resnets, then a stride-2 conv on a bottom/right
zero pad) -> mid (resnet, attention, resnet) -> GroupNorm + SiLU -> conv_out -> [quant_conv]
-> moments ``[mean, logvar]`` (2 x latent channels).

One architecture covers FLUX.1 (16 ch, no quant conv), SD3 (16 ch), SDXL / SD1.5 (4 ch,
quant conv) and FLUX.2 (32 ch, quant conv, plus the latent BatchNorm statistics that
``encode.Encoder.normalize`` applies). Parameter names are diffusers' minus the ``encoder.``
prefix (plus ``quant_conv`` and ``bn.running_*``). The resnet and mid blocks are the
decoder's (``app.families.flux.decoder.model``): the same layers, the same names.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from app.families.attention import attend
from app.families.encoder import VAEEncoder
from app.families.flux.decoder.model import (
    FLUX1_CONFIG,
    GN_EPS,
    LatentStats,
    MidBlock,
    ResnetBlock,
    SpatialAttention,
)

# FLUX.1's encoder: the decoder's config keys, plus the encoder-only ones.
ENCODER_CONFIG: dict[str, Any] = {
    **{k: v for k, v in FLUX1_CONFIG.items() if k not in ("out_channels", "use_post_quant_conv")},
    "in_channels": 3,
    "use_quant_conv": False,
    # diffusers' ``enable_tiling`` geometry: tiles of sample_size pixels, overlapping by 1/4.
    "sample_size": 1024,
    "tile_overlap_factor": 0.25,
}


class Downsample(nn.Module):
    """Zero-pad one row/column at the bottom/right, then a 3x3 stride-2 conv (no padding)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class DownBlock(nn.Module):
    def __init__(self, cin: int, cout: int, n_resnets: int, groups: int, downsample: bool) -> None:
        super().__init__()
        widths = [cin] + [cout] * n_resnets
        self.resnets = nn.ModuleList(
            ResnetBlock(widths[i], widths[i + 1], groups) for i in range(n_resnets)
        )
        self.downsamplers = nn.ModuleList([Downsample(cout)] if downsample else [])

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        for down in self.downsamplers:
            x = down(x)
        return x


class MidAttention(SpatialAttention):
    """The decoder's attention (same weights) through ``attend``: no (H*W)^2 scores on any
    device (the decoder's relies on SDPA picking a fused kernel)."""

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        tokens = self.group_norm(x).flatten(2).transpose(1, 2)  # [B, HW, C]
        q, k, v = (proj(tokens).unsqueeze(1) for proj in (self.to_q, self.to_k, self.to_v))
        out = self.to_out[0](attend(q, k, v).squeeze(1))
        return x + out.transpose(1, 2).reshape(b, c, h, w)


class EncoderMidBlock(MidBlock):
    def __init__(self, channels: int, groups: int, attention: bool) -> None:
        super().__init__(channels, groups, attention)
        self.attentions = nn.ModuleList([MidAttention(channels, groups)] if attention else [])


class EncoderModel(VAEEncoder):
    """The layers and the forward (pixels -> moments); ``encode.Encoder`` adds the rest."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__({**ENCODER_CONFIG, **config})
        cfg = self.config
        widths, groups = list(cfg["block_out_channels"]), cfg["norm_num_groups"]
        latent = cfg["latent_channels"]
        self.conv_in = nn.Conv2d(cfg["in_channels"], widths[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            DownBlock(
                widths[max(i - 1, 0)],
                widths[i],
                cfg["layers_per_block"],
                groups,
                downsample=i < len(widths) - 1,
            )
            for i in range(len(widths))
        )
        self.mid_block = EncoderMidBlock(widths[-1], groups, cfg["mid_block_add_attention"])
        self.conv_norm_out = nn.GroupNorm(groups, widths[-1], eps=GN_EPS)
        self.conv_act = nn.SiLU()
        self.conv_out = nn.Conv2d(widths[-1], 2 * latent, 3, padding=1)
        self.quant_conv = nn.Conv2d(2 * latent, 2 * latent, 1) if cfg["use_quant_conv"] else None
        self.bn = LatentStats(4 * latent) if cfg["latent_bn"] else None

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        x = self.conv_out(self.conv_act(self.conv_norm_out(x)))
        return x if self.quant_conv is None else self.quant_conv(x)
