"""The Wan VAE decoder: Wan 2.1, Wan 2.2 TI2V and Qwen-Image's ``AutoencoderKLQwenImage``.

latent [B,z,T,H,W] -> post_quant_conv -> conv_in -> mid (resnet, attention, resnet)
-> up blocks (resnets, then a 2x upsampler: spatial, or spatial + temporal) -> RMSNorm -> SiLU
-> conv_out [-> unpatchify 2x2 (Wan 2.2)] -> clamp -> RGB [B,3,1+4(T-1),8H,8W] (x16 for 2.2)

Variants (one config, diffusers' ``AutoencoderKLWan`` names):
  Wan 2.1 / Qwen-Image  16 channels; an upsampler halves the channels it hands on.
  Wan 2.2 TI2V          48 channels, ``is_residual``: each up block adds a parameter-free
                        "duplicate up" shortcut of its input; 12 output channels unpatchified
                        2x2 (``patch_size`` 2).

Time. Every layer is frame-local (RMSNorm over channels, attention within a frame, 2-D
upsampling convs) except the causal 3-D convs. A causal conv sees its input preceded by two
ZERO frames at the start of the stream (not repeated frames, as in LTX), then the last two
frames it saw: the reference decodes one latent frame per call with a frame cache, and that is
the same arithmetic as one causal pass. So the decoder streams exactly, any number of latent
frames at a time (``FrameCache`` holds each conv's two-frame carry). One first-frame rule: a
temporal upsampler passes the stream's first frame through undoubled and unseen by its time
conv, which starts on the second frame with a zero carry; so T latent frames make 1 + 2(T-1)
frames per temporal upsampler. Wan 2.2's duplicate-up shortcut drops its first frame to match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.families.attention import attend
from app.families.ops import conv3d


@dataclass
class FrameCache:
    """The temporal state of one decode (of one tile): conv carries and first-chunk flags."""

    carry: dict[nn.Module, Tensor] = field(default_factory=dict)
    started: set[nn.Module] = field(default_factory=set)

    def causal(self, conv: nn.Module, x: Tensor, frames: int) -> Tensor:
        """``x`` preceded by the last ``frames`` frames before it (zeros at the start)."""
        prev = self.carry.get(conv)
        # zero frames by padding, which keeps x's memory format (a cat with new zeros may not)
        seq = F.pad(x, (0, 0, 0, 0, frames, 0)) if prev is None else torch.cat([prev, x], 2)
        # a copy: a view would pin the whole concatenated input until the next chunk
        self.carry[conv] = seq[:, :, seq.shape[2] - frames :].clone()
        return seq

    def first_call(self, module: nn.Module) -> bool:
        """True exactly once per module: on the chunk that starts the stream."""
        if module in self.started:
            return False
        self.started.add(module)
        return True


# --- layers -------------------------------------------------------------------------------
class ZeroPadCausalConv3d(nn.Conv3d):
    """Conv3d, zero-padded in space, causal in time (two zero frames, then the carry)."""

    def __init__(self, cin: int, cout: int, kernel: int | tuple[int, int, int]) -> None:
        k = (kernel,) * 3 if isinstance(kernel, int) else kernel
        super().__init__(cin, cout, k, padding=(0, k[1] // 2, k[2] // 2))

    def forward(self, x: Tensor, s: FrameCache | None = None) -> Tensor:
        kt = self.kernel_size[0]
        if kt > 1:
            assert s is not None, "a temporal conv needs its stream"
            x = s.causal(self, x, kt - 1)
        return conv3d(x, self)


class RMSNorm(nn.Module):
    """x / ||x||_channels * sqrt(C) * gamma (diffusers' WanRMS_norm; no bias in Wan)."""

    def __init__(self, dim: int, video: bool = True) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones((dim, 1, 1, 1) if video else (dim, 1, 1)))
        self.scale = dim**0.5

    def forward(self, x: Tensor) -> Tensor:
        low = x.dtype in (torch.float16, torch.bfloat16)
        normalized = F.normalize(x.float() if low else x, dim=1).to(x.dtype)
        return normalized * self.scale * self.gamma


class ResidualBlock(nn.Module):
    """x' = shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cin)
        self.conv1 = ZeroPadCausalConv3d(cin, cout, 3)
        self.norm2 = RMSNorm(cout)
        self.conv2 = ZeroPadCausalConv3d(cout, cout, 3)
        self.conv_shortcut = ZeroPadCausalConv3d(cin, cout, 1) if cin != cout else None

    def forward(self, x: Tensor, s: FrameCache) -> Tensor:
        skip = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        h = self.conv1(F.silu(self.norm1(x)), s)
        h = self.conv2(F.silu(self.norm2(h)), s)
        return h + skip


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame, residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, video=False)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)
        qkv = self.to_qkv(self.norm(frames)).reshape(b * t, 1, c * 3, h * w).transpose(2, 3)
        q, k, v = qkv.chunk(3, dim=-1)
        out = attend(q, k, v)  # [bt, 1, hw, c]; the chunks' last dim is strided: not fused
        out = self.proj(out.squeeze(1).transpose(1, 2).reshape(b * t, c, h, w))
        return x + out.view(b, t, c, h, w).transpose(1, 2)


class Upsample2x(nn.Module):
    """Nearest 2x in H and W (exact in every dtype: a copy of each pixel)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.repeat_interleave(2, dim=-2).repeat_interleave(2, dim=-1)


class Upsampler(nn.Module):
    """[time conv doubling frames,] then per frame nearest 2x + 3x3 conv (to ``cout``)."""

    def __init__(self, dim: int, cout: int, temporal: bool) -> None:
        super().__init__()
        self.resample = nn.Sequential(Upsample2x(), nn.Conv2d(dim, cout, 3, padding=1))
        self.time_conv = ZeroPadCausalConv3d(dim, dim * 2, (3, 1, 1)) if temporal else None

    def forward(self, x: Tensor, s: FrameCache) -> Tensor:
        if self.time_conv is not None:
            x = self._double_frames(x, s)
        b, c, t, h, w = x.shape
        y = self.resample(x.transpose(1, 2).reshape(b * t, c, h, w))
        return y.view(b, t, *y.shape[1:]).transpose(1, 2)

    def _double_frames(self, x: Tensor, s: FrameCache) -> Tensor:
        """Each frame -> two (the time conv's two channel halves), except the stream's first."""
        first = []
        if s.first_call(self):
            first, x = [x[:, :, :1]], x[:, :, 1:]
        if x.shape[2]:
            b, c, t, h, w = x.shape
            y = self.time_conv(x, s).view(b, 2, c, t, h, w)
            x = y.permute(0, 2, 3, 1, 4, 5).reshape(b, c, t * 2, h, w)
            first.append(x)
        return torch.cat(first, 2) if len(first) > 1 else first[0]


def duplicate_up(x: Tensor, cout: int, factor_t: int) -> Tensor:
    """Wan 2.2's parameter-free shortcut: repeat channels, then depth-to-space (t, 2, 2)."""
    b, cin, t, h, w = x.shape
    x = x.repeat_interleave(cout * factor_t * 4 // cin, dim=1)
    x = x.view(b, cout, factor_t, 2, 2, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    return x.reshape(b, cout, t * factor_t, h * 2, w * 2)


class MidBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: Tensor, s: FrameCache) -> Tensor:
        x = self.resnets[0](x, s)
        return self.resnets[1](self.attentions[0](x), s)


class UpBlock(nn.Module):
    """Wan 2.1 / Qwen-Image: resnets, then an upsampler that halves the channels."""

    def __init__(self, cin: int, cout: int, layers: int, up: str | None) -> None:
        super().__init__()
        dims = [cin] + [cout] * layers
        self.resnets = nn.ModuleList(
            ResidualBlock(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True)
        )
        self.upsamplers = None
        if up is not None:
            self.upsamplers = nn.ModuleList([Upsampler(cout, cout // 2, up == "3d")])

    def forward(self, x: Tensor, s: FrameCache) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x, s)
        return self.upsamplers[0](x, s) if self.upsamplers is not None else x


class ResidualUpBlock(nn.Module):
    """Wan 2.2: resnets and an upsampler (same width), plus the duplicate-up shortcut."""

    def __init__(self, cin: int, cout: int, layers: int, up: str | None) -> None:
        super().__init__()
        dims = [cin] + [cout] * layers
        self.resnets = nn.ModuleList(
            ResidualBlock(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True)
        )
        self.upsampler = Upsampler(cout, cout, up == "3d") if up is not None else None
        self.cout, self.factor_t = cout, 2 if up == "3d" else 1

    def forward(self, x: Tensor, s: FrameCache) -> Tensor:
        h = x
        for resnet in self.resnets:
            h = resnet(h, s)
        if self.upsampler is None:
            return h
        h = self.upsampler(h, s)
        skip = duplicate_up(x, self.cout, self.factor_t)
        if s.first_call(self):  # the upsampler did not double the stream's first frame
            skip = skip[:, :, self.factor_t - 1 :]
        return h + skip


# --- the architecture ----------------------------------------------------------------------
class Architecture(nn.Module):
    """The decoder network (``config``: the diffusers ``AutoencoderKLWan`` names, see
    ``convert.py``); ``forward`` continues a ``FrameCache``, so it runs a clip in one call or
    as a stream of frame chunks."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        z, dim, mult = config["z_dim"], config["decoder_base_dim"], config["dim_mult"]
        residual = bool(config.get("is_residual", False))
        temporal = list(reversed(config["temperal_downsample"]))
        layers = config["num_res_blocks"] + 1
        self.patch = int(config.get("patch_size") or 1)
        dims = [dim * m for m in [mult[-1], *reversed(mult)]]
        self.post_quant_conv = ZeroPadCausalConv3d(z, z, 1)
        self.conv_in = ZeroPadCausalConv3d(z, dims[0], 3)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList()
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            last = i == len(mult) - 1
            up = None if last else ("3d" if temporal[i] else "2d")
            if residual:
                self.up_blocks.append(ResidualUpBlock(cin, cout, layers, up))
            else:  # the previous upsampler halved the channels
                self.up_blocks.append(UpBlock(cin // 2 if i else cin, cout, layers, up))
        self.norm_out = RMSNorm(dims[-1])
        # out_channels counts conv_out's channels: 3, or 12 to unpatchify 2x2 (Wan 2.2)
        self.conv_out = ZeroPadCausalConv3d(dims[-1], config.get("out_channels", 3), 3)
        self.upsamples = len(mult) - 1
        self.temporal_ups = sum(bool(t) for t in temporal[: self.upsamples])

    def forward(self, z: Tensor, cache: FrameCache | None = None) -> Tensor:
        """Latent frames -> output frames (patched, unclamped), continuing ``cache`` (a fresh
        one: the clip from its start)."""
        cache = FrameCache() if cache is None else cache
        x = self.conv_in(self.post_quant_conv(z), cache)
        x = self.mid_block(x, cache)
        for block in self.up_blocks:
            x = block(x, cache)
        return self.conv_out(F.silu(self.norm_out(x)), cache)


def unpatchify(x: Tensor, p: int) -> Tensor:
    """[B, c*p*p, T, H, W] -> [B, c, T, pH, pW]; channel (c, column offset, row offset)."""
    if p == 1:
        return x
    b, cpp, t, h, w = x.shape
    x = x.view(b, cpp // (p * p), p, p, t, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, cpp // (p * p), t, h * p, w * p)
