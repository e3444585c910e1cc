"""The HunyuanVideo causal 3-D VAE encoder, exactly (diffusers' ``AutoencoderKLHunyuanVideo``).

RGB [B,3,T,H,W] -> conv_in -> down blocks (resnets, then a strided causal conv: 2x in space
in the first log2(spatial) blocks, 2x in time in the two blocks before the last) -> mid
(resnet, causal attention, resnet) -> GroupNorm -> SiLU -> conv_out -> quant_conv
-> moments [mean, logvar] [B,32,1+(T-1)/4,H/8,W/8]

The layers are the decoder family's: every 3-D conv pads by replication (two copies of the
first frame before the clip, repeated borders in H and W), GroupNorm statistics span the whole
clip and the mid attention lets frame f see frames 0..f, so one pass is indivisible; the
reference cuts long clips into overlapping windows and blends them (``encode.py``). A strided
downsampler conv over ``2 + T`` frames gives ``1 + (T - 1) // 2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from app.families.attention import attend
from app.families.hunyuan_video.decoder.model import (
    EPS,
    CausalAttention,
    MidBlock,
    ReplicateCausalConv3d,
    ResnetBlock,
)


@dataclass(frozen=True)
class EncoderSpec:
    in_channels: int
    latent_channels: int
    widths: tuple[int, ...]
    layers: int
    groups: int
    strides: tuple[tuple[int, int, int] | None, ...]  # each down block's (T, H, W); None: none
    attention: bool


def down_strides(
    blocks: int, spatial_ratio: int, temporal_ratio: int
) -> list[tuple[int, int, int] | None]:
    """Each down block's downsampler stride, as HunyuanVideo places them: space in the first
    log2(spatial) blocks, time in the two before the last. (The reference's encoder also has
    an 8x-time layout, but its VAE cannot be built with one: its decoder refuses it.)"""
    if temporal_ratio != 4:
        raise ValueError(f"temporal_compression_ratio {temporal_ratio}: HunyuanVideo has 4")
    spatial, temporal = int(math.log2(spatial_ratio)), int(math.log2(temporal_ratio))
    out: list[tuple[int, int, int] | None] = []
    for i in range(blocks):
        in_time = blocks - 1 - temporal <= i < blocks - 1
        in_space = i < spatial
        out.append((2 if in_time else 1, 2 if in_space else 1, 2 if in_space else 1))
        if not (in_time or in_space):
            out[-1] = None
    return out


class StridedCausalConv3d(ReplicateCausalConv3d):
    """The decoder family's replicate-padded causal conv with a stride (the downsamplers)."""

    def __init__(self, dim: int, stride: tuple[int, int, int]) -> None:
        super().__init__(dim, dim, 3)
        self.conv.stride = stride


class Downsampler(nn.Module):
    def __init__(self, dim: int, stride: tuple[int, int, int]) -> None:
        super().__init__()
        self.conv = StridedCausalConv3d(dim, stride)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class DownBlock(nn.Module):
    def __init__(
        self, cin: int, cout: int, spec: EncoderSpec, stride: tuple[int, int, int] | None
    ) -> None:
        super().__init__()
        dims = [cin] + [cout] * spec.layers
        self.resnets = nn.ModuleList(
            ResnetBlock(a, b, spec.groups) for a, b in zip(dims[:-1], dims[1:], strict=True)
        )
        self.downsamplers = None
        if stride is not None:
            self.downsamplers = nn.ModuleList([Downsampler(cout, stride)])

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return self.downsamplers[0](x) if self.downsamplers is not None else x


class MidAttention(CausalAttention):
    """The decoder family's block-causal attention (same weights), one query frame at a time
    through ``attend``: no (H*W) x (T*H*W) scores on any device."""

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        tokens = self.group_norm(x).flatten(2).transpose(1, 2)  # [B, T*H*W, C], (t, h, w) order
        q, k, v = (proj(tokens).unsqueeze(1) for proj in (self.to_q, self.to_k, self.to_v))
        n = h * w
        frames = [
            attend(q[:, :, f * n : (f + 1) * n], k[:, :, : (f + 1) * n], v[:, :, : (f + 1) * n])
            for f in range(t)
        ]
        out = self.to_out[0](torch.cat(frames, dim=2).squeeze(1))
        return x + out.transpose(1, 2).reshape(b, c, t, h, w)


class EncoderMidBlock(MidBlock):
    def __init__(self, dim: int, groups: int, attention: bool) -> None:
        super().__init__(dim, groups, attention)
        self.attentions = nn.ModuleList([MidAttention(dim, groups)] if attention else [])


class EncoderNet(nn.Module):
    """diffusers' ``vae.encoder``: one window of frames in one pass."""

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        w = spec.widths
        self.conv_in = ReplicateCausalConv3d(spec.in_channels, w[0])
        self.down_blocks = nn.ModuleList(
            DownBlock(cin, cout, spec, stride)
            for cin, cout, stride in zip([w[0], *w[:-1]], w, spec.strides, strict=True)
        )
        self.mid_block = EncoderMidBlock(w[-1], spec.groups, spec.attention)
        self.conv_norm_out = nn.GroupNorm(spec.groups, w[-1], eps=EPS)
        self.conv_act = nn.SiLU()
        self.conv_out = ReplicateCausalConv3d(w[-1], 2 * spec.latent_channels)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(self.conv_act(self.conv_norm_out(x)))
