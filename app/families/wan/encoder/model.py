"""The Wan VAE encoder, exactly: Wan 2.1, Wan 2.2 TI2V (``AutoencoderKLWan``) and Qwen-Image
(``AutoencoderKLQwenImage``).

RGB [B,3,T,H,W] [-> patchify 2x2 (Wan 2.2)] -> conv_in -> down stages -> mid (resnet,
attention, resnet) -> RMSNorm -> SiLU -> conv_out -> quant_conv -> moments [mean, logvar]

Down stages (one per ``dim_mult`` step but the last):
  Wan 2.1 / Qwen-Image  a flat list: resnets [+ attention], then a downsampler (2-D stride-2
                        conv per frame, zero-padded right and bottom; ``3d``: then a stride-2
                        time conv).
  Wan 2.2 TI2V          ``is_residual``: each block adds a parameter-free shortcut (the
                        input's space-to-depth averaged over channel groups, time zero-padded
                        in front to an even count) to its resnets + downsampler.

Time. The layers reuse the decoder family's (``FrameCache``: each 3-tap causal conv sees two zero
frames at the start of the stream, then the last two frames it saw). The reference encodes
frame 0 alone, then 4 frames at a time with a feature cache; that is one causal pass, with one
first-frame rule: a temporal downsampler passes the stream's first frame through unseen by its
time conv, which then runs (stride 2, unpadded) from that frame on, so 1 + 2k frames become
1 + k. Any chunking whose first chunk is 1 + 4k frames and the rest 4k frames is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.families.attention import attend
from app.families.ops import conv3d
from app.families.wan.decoder.model import (
    AttentionBlock,
    FrameCache,
    MidBlock,
    ResidualBlock,
    RMSNorm,
    ZeroPadCausalConv3d,
)


class EncoderStream(FrameCache):
    """The decoder family's frame cache (each carry copied out of its chunk: no pinned
    inputs) that keeps no carry from the stream's ``final`` chunk: none would read it, and
    for one chunk (an image) each conv's two-frame carry would be a full map held to the end."""

    final: bool = False

    def causal(self, conv: nn.Module, x: Tensor, frames: int) -> Tensor:
        if not self.final:
            return super().causal(conv, x, frames)
        prev = self.carry.pop(conv, None)
        return F.pad(x, (0, 0, 0, 0, frames, 0)) if prev is None else torch.cat([prev, x], 2)


@dataclass(frozen=True)
class EncoderSpec:
    in_channels: int  # conv_in's (after patchify: 12 in Wan 2.2)
    base_dim: int
    z_dim: int
    dim_mult: tuple[int, ...]
    num_res_blocks: int
    attn_scales: tuple[float, ...]
    temperal_downsample: tuple[bool, ...]
    is_residual: bool


def frames_2d(x: Tensor, layer: nn.Module) -> Tensor:
    """A 2-D ``layer`` applied to every frame of [B, C, T, H, W]."""
    b, c, t, h, w = x.shape
    y = layer(x.transpose(1, 2).reshape(b * t, c, h, w))
    return y.view(b, t, *y.shape[1:]).transpose(1, 2)


class Downsampler(nn.Module):
    """Per frame: zero-pad right/bottom, 3x3 stride-2 conv; ``temporal``: then a stride-2
    time conv from the stream's first frame on, that frame itself passed through."""

    def __init__(self, dim: int, temporal: bool) -> None:
        super().__init__()
        self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, 2))
        self.time_conv = nn.Conv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1)) if temporal else None

    def forward(self, x: Tensor, s: EncoderStream) -> Tensor:
        x = frames_2d(x, self.resample)
        if self.time_conv is None:
            return x
        out = []
        if s.first_call(self):
            out.append(x[:, :, :1])
            seq = x
        else:
            seq = torch.cat([s.carry.pop(self), x], 2)
        if not s.final:
            s.carry[self] = seq[:, :, -1:].clone()
        if seq.shape[2] >= 3:
            out.append(conv3d(seq, self.time_conv))
        return torch.cat(out, 2) if len(out) > 1 else out[0]


class MidAttention(AttentionBlock):
    """The decoder family's attention block (same weights) through ``attend``. The decoder's
    hands SDPA q, k, v as views strided along their last dimension, which no fused kernel
    takes: the math kernel then builds the (H*W)^2 scores of every frame."""

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)
        qkv = self.to_qkv(self.norm(frames)).flatten(2).transpose(1, 2).contiguous()
        q, k, v = qkv.unsqueeze(1).chunk(3, dim=-1)  # [bt, 1, hw, c] each
        out = attend(q, k, v).squeeze(1).transpose(1, 2).reshape(b * t, c, h, w)
        return x + self.proj(out).view(b, t, c, h, w).transpose(1, 2)


class EncoderMidBlock(MidBlock):
    """The decoder family's mid block with ``MidAttention``."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.attentions = nn.ModuleList([MidAttention(dim)])


class AvgDown(nn.Module):
    """Wan 2.2's shortcut: time zero-padded in front to a multiple of ``factor_t``, then
    space-to-depth (t, s, s) and the mean over each group of channels."""

    def __init__(self, cin: int, cout: int, factor_t: int, factor_s: int) -> None:
        super().__init__()
        self.factor_t, self.factor_s = factor_t, factor_s
        self.cout = cout
        self.group = cin * factor_t * factor_s * factor_s // cout

    def forward(self, x: Tensor) -> Tensor:
        ft, fs = self.factor_t, self.factor_s
        x = F.pad(x, (0, 0, 0, 0, (ft - x.shape[2] % ft) % ft, 0))
        b, c, t, h, w = x.shape
        x = x.reshape(b, c, t // ft, ft, h // fs, fs, w // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6)
        x = x.reshape(b, self.cout, self.group, t // ft, h // fs, w // fs)
        return x.mean(2)


class ResidualDownBlock(nn.Module):
    """Wan 2.2: resnets [+ downsampler] plus the ``AvgDown`` shortcut of the block's input."""

    def __init__(self, cin: int, cout: int, layers: int, temporal: bool, down: bool) -> None:
        super().__init__()
        self.avg_shortcut = AvgDown(cin, cout, 2 if temporal else 1, 2 if down else 1)
        dims = [cin] + [cout] * layers
        self.resnets = nn.ModuleList(
            ResidualBlock(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True)
        )
        self.downsampler = Downsampler(cout, temporal) if down else None

    def forward(self, x: Tensor, s: EncoderStream) -> Tensor:
        skip = self.avg_shortcut(x)
        for resnet in self.resnets:
            x = resnet(x, s)
        if self.downsampler is not None:
            x = self.downsampler(x, s)
        return x + skip


class EncoderNet(nn.Module):
    """diffusers' ``vae.encoder`` (without ``quant_conv``), one chunk of a stream per call."""

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        dims = [spec.base_dim * u for u in (1, *spec.dim_mult)]
        self.conv_in = ZeroPadCausalConv3d(spec.in_channels, dims[0], 3)
        self.down_blocks = nn.ModuleList()
        last = len(spec.dim_mult) - 1
        scale = 1.0
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            temporal = i != last and spec.temperal_downsample[i]
            if spec.is_residual:
                block = ResidualDownBlock(cin, cout, spec.num_res_blocks, temporal, i != last)
                self.down_blocks.append(block)
                continue
            for _ in range(spec.num_res_blocks):
                self.down_blocks.append(ResidualBlock(cin, cout))
                if scale in spec.attn_scales:
                    self.down_blocks.append(AttentionBlock(cout))
                cin = cout
            if i != last:
                self.down_blocks.append(Downsampler(cout, temporal))
                scale /= 2.0
        self.mid_block = EncoderMidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1])
        self.nonlinearity = nn.SiLU()
        self.conv_out = ZeroPadCausalConv3d(dims[-1], spec.z_dim * 2, 3)

    def forward(self, x: Tensor, s: EncoderStream) -> Tensor:
        x = self.conv_in(x, s)
        for layer in self.down_blocks:
            x = layer(x) if isinstance(layer, AttentionBlock) else layer(x, s)
        x = self.mid_block(x, s)
        return self.conv_out(self.nonlinearity(self.norm_out(x)), s)


def patchify(x: Tensor, patch: int) -> Tensor:
    """[B, c, T, H, W] -> [B, c*p*p, T, H/p, W/p]; channel order (c, dx, dy)."""
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t, h // patch, patch, w // patch, patch).permute(0, 1, 6, 4, 2, 3, 5)
    return x.reshape(b, c * patch * patch, t, h // patch, w // patch)
