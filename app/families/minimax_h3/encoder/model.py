"""MiniMax-H3's 3-D causal CNN VAE encoder, exactly (diffusers' ``AutoencoderKLMiniMaxH3``).

RGB [B,3,T,H,W] -> conv_in -> down blocks (resnets, then a strided 3x3x3 conv by the level's
``(temporal, spatial)`` factors) -> GroupNorm -> SiLU -> conv_out -> quant_conv
-> moments [mean, logvar] [B,48,...]

Every 3x3x3 conv pads space by reflection (``spatial_padding_mode``) and time with two ZERO
frames in front; a spatially strided conv is instead padded by one reflected row and column
at the bottom and right (so ``ceil(size / 2)``), a time-only one not at all in space.
GroupNorm statistics are per frame (the original's ``use_t_isolated_gn``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from app.families.ops import conv3d


@dataclass(frozen=True)
class EncoderSpec:
    in_channels: int
    latent_channels: int
    widths: tuple[int, ...]
    layers: int
    spatial: tuple[int, ...]  # each level's spatial downsampling factor
    temporal: tuple[int, ...]  # each level's temporal one
    groups: int
    eps: float
    padding_mode: str


class ZeroFrameCausalConv3d(nn.Conv3d):
    """Conv3d after ``pad`` reflected pixels on each side and ``pad_t`` zero frames in front."""

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: int,
        pad: int = 0,
        pad_t: int = 0,
        stride: tuple[int, int, int] = (1, 1, 1),
        mode: str = "reflect",
    ) -> None:
        super().__init__(cin, cout, kernel, stride=stride)
        self.pad, self.pad_t, self.mode = pad, pad_t, mode

    def forward(self, x: Tensor) -> Tensor:
        if self.pad:
            x = F.pad(x, (self.pad,) * 4 + (0, 0), mode=self.mode)
        if self.pad_t:
            x = F.pad(x, (0, 0, 0, 0, self.pad_t, 0))
        return conv3d(x, self)


class FrameGroupNorm(nn.GroupNorm):
    """GroupNorm with statistics over each frame alone."""

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)
        return super().forward(frames).view(b, t, c, h, w).transpose(1, 2)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, spec: EncoderSpec) -> None:
        super().__init__()
        self.norm1 = FrameGroupNorm(spec.groups, cin, eps=spec.eps)
        self.conv1 = ZeroFrameCausalConv3d(cin, cout, 3, 1, 2, mode=spec.padding_mode)
        self.norm2 = FrameGroupNorm(spec.groups, cout, eps=spec.eps)
        self.conv2 = ZeroFrameCausalConv3d(cout, cout, 3, 1, 2, mode=spec.padding_mode)
        self.conv_shortcut = ZeroFrameCausalConv3d(cin, cout, 1) if cin != cout else None

    def forward(self, x: Tensor) -> Tensor:
        skip = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        h = self.conv1(F.silu(self.norm1(x)))
        return skip + self.conv2(F.silu(self.norm2(h)))


class Downsampler(nn.Module):
    """A strided 3x3x3 conv; a spatial stride 2 is preceded by a reflected bottom/right row."""

    def __init__(self, dim: int, factor_t: int, factor_s: int, mode: str) -> None:
        super().__init__()
        self.factor_s, self.mode = factor_s, mode
        self.conv = ZeroFrameCausalConv3d(dim, dim, 3, 0, 2, (factor_t, factor_s, factor_s), mode)

    def forward(self, x: Tensor) -> Tensor:
        if self.factor_s == 2:
            x = F.pad(x, (0, 1, 0, 1, 0, 0), mode=self.mode)
        return self.conv(x)


class DownBlock(nn.Module):
    def __init__(self, cin: int, cout: int, factor_t: int, factor_s: int, spec: EncoderSpec):
        super().__init__()
        dims = [cin] + [cout] * spec.layers
        self.resnets = nn.ModuleList(
            ResnetBlock(a, b, spec) for a, b in zip(dims[:-1], dims[1:], strict=True)
        )
        self.downsamplers = None
        if factor_t * factor_s > 1:
            down = Downsampler(cout, factor_t, factor_s, spec.padding_mode)
            self.downsamplers = nn.ModuleList([down])

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return self.downsamplers[0](x) if self.downsamplers is not None else x


class EncoderNet(nn.Module):
    """diffusers' ``vae.encoder``: one clip (one tile) in one pass."""

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        w = spec.widths
        self.conv_in = ZeroFrameCausalConv3d(
            spec.in_channels, w[0], 3, 1, 2, mode=spec.padding_mode
        )
        self.down_blocks = nn.ModuleList(
            DownBlock(cin, cout, ft, fs, spec)
            for cin, cout, ft, fs in zip(
                [w[0], *w[:-1]], w, spec.temporal, spec.spatial, strict=True
            )
        )
        self.norm_out = FrameGroupNorm(spec.groups, w[-1], eps=spec.eps)
        self.conv_act = nn.SiLU()
        self.conv_out = ZeroFrameCausalConv3d(
            w[-1], 2 * spec.latent_channels, 3, 1, 2, mode=spec.padding_mode
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        return self.conv_out(self.conv_act(self.norm_out(x)))
