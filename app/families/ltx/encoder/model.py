"""The LTX-Video encoder, exactly: ``AutoencoderKLLTXVideo`` (0.9.x) and
``AutoencoderKLLTX2Video``'s encoder half.

RGB [B,3,T,H,W] -> patchify (p x p pixels, p_t frames -> channels) -> conv_in -> down blocks
(resnets, a downsampler, [0.9.0: a channel-changing resnet]) -> mid (resnets) -> RMSNorm ->
SiLU -> conv_out (latent + 1 channels) -> moments [mean, logvar x latent]: the one logvar
channel is shared by every latent channel.

Down block kinds (``down_block_types`` / ``downsample_type``):
  0.9.0/0.9.1 ``LTXVideoDownBlock3D``: a stride-2 (T, H, W) 3x3x3 conv, then a resnet that
      changes the width (LayerNorm + 1x1 shortcut) when the next block is wider.
  0.9.5+ and LTX-2 (``LTXVideo095DownBlock3D`` / ``LTX2VideoDownBlock3D``): ``conv`` as above,
      or a space-to-depth downsampler (``spatial`` (1,2,2), ``temporal`` (2,1,1),
      ``spatiotemporal`` (2,2,2)) whose residual is the input's own space-to-depth averaged
      over channel groups; the width changes there.
Every 3x3x3 conv pads time with edge frames (2 on the left when causal, 1 each side when not)
and space with zeros (LTX-2: ``encoder_spatial_padding_mode``). Every other layer is
frame-local, so a causal encoder also runs as a stream of frame chunks (``EncodeChunkState``:
each conv carries the frames its next window needs, the first chunk's first frame repeated
before it); exact for a first chunk of ``1 + k * temporal_scale`` frames and then whole
multiples. LTX-2 differs further in its ``conv_in`` (to ``latent_channels`` wide), its plain 1x1 shortcuts and its resnet norms
(RMSNorm over channels either way: the decoder family's ``RMSNorm``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from app.families.ltx.decoder.model import RMSNorm
from app.families.ops import conv3d

DOWNSAMPLE_STRIDES: dict[str, tuple[int, int, int]] = {
    "conv": (2, 2, 2),
    "spatial": (1, 2, 2),
    "temporal": (2, 1, 1),
    "spatiotemporal": (2, 2, 2),
}


@dataclass(frozen=True)
class BlockSpec:
    cin: int
    cout: int
    layers: int
    downsample: str | None  # a DOWNSAMPLE_STRIDES key, None: no downsampler
    conv_out: bool  # 0.9.0-style channel-changing resnet after the downsampler


@dataclass(frozen=True)
class EncoderSpec:
    in_channels: int
    latent_channels: int
    stem_channels: int
    blocks: tuple[BlockSpec, ...]
    mid_channels: int
    mid_layers: int
    patch: int
    patch_t: int
    causal: bool
    eps: float
    padding_mode: str
    plain_shortcut: bool  # LTX-2: nn.Conv3d shortcut (0.9.x: a causal conv wrapper)


@dataclass
class EncodeChunkState:
    """The temporal state of a causal encode run over frame chunks: each conv's unconsumed
    frames, and which layers have seen the stream's first chunk."""

    carry: dict[nn.Module, Tensor] = field(default_factory=dict)
    started: set[nn.Module] = field(default_factory=set)

    def first_call(self, module: nn.Module) -> bool:
        if module in self.started:
            return False
        self.started.add(module)
        return True


# --- layers -------------------------------------------------------------------------------
class EdgeFramePadConv3d(nn.Module):
    """Conv3d with time padded by repeating edge frames (``.conv`` holds diffusers' weights)."""

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: int,
        causal: bool,
        stride: tuple[int, int, int] = (1, 1, 1),
        padding_mode: str = "zeros",
    ) -> None:
        super().__init__()
        pad = kernel // 2
        self.conv = nn.Conv3d(
            cin, cout, kernel, stride=stride, padding=(0, pad, pad), padding_mode=padding_mode
        )
        self.kt = kernel
        self.causal = causal

    def forward(self, x: Tensor, s: EncodeChunkState | None = None) -> Tensor:
        if self.kt > 1 and s is not None:
            return self._streamed(x, s)
        if self.kt > 1:
            left = self.kt - 1 if self.causal else (self.kt - 1) // 2
            right = 0 if self.causal else (self.kt - 1) // 2
            parts = [x[:, :, :1].expand(-1, -1, left, -1, -1), x]
            if right:
                parts.append(x[:, :, -1:].expand(-1, -1, right, -1, -1))
            x = torch.cat(parts, 2)
        return self._run(x)

    def _run(self, x: Tensor) -> Tensor:
        if self.conv.padding_mode != "zeros":  # nn.Conv3d pads H, W itself
            return self.conv(x)
        return conv3d(x, self.conv)

    def _streamed(self, x: Tensor, s: EncodeChunkState) -> Tensor:
        """Causal only: the carried frames (at the start: the first frame repeated) + ``x``;
        what the next window still needs is carried on (copied, not a view of the chunk)."""
        prev = s.carry.get(self)
        if prev is None:
            prev = x[:, :, :1].expand(-1, -1, self.kt - 1, -1, -1)
        seq = torch.cat([prev, x], 2)
        if seq.shape[2] < self.kt:
            raise ValueError(f"a chunk of {x.shape[2]} frames is too short to stream")
        st = self.conv.stride[0]
        windows = (seq.shape[2] - self.kt) // st + 1
        s.carry[self] = seq[:, :, windows * st :].clone()
        return self._run(seq[:, :, : (windows - 1) * st + self.kt])


class ResnetBlock(nn.Module):
    """x + conv2(silu(norm2(conv1(silu(norm1(x)))))), the skip through LayerNorm + 1x1 conv
    when the width changes."""

    def __init__(self, cin: int, cout: int, spec: EncoderSpec) -> None:
        super().__init__()
        self.norm1 = RMSNorm()
        self.conv1 = _conv(cin, cout, spec)
        self.norm2 = RMSNorm()
        self.conv2 = _conv(cout, cout, spec)
        self.nonlinearity = nn.SiLU()
        self.norm3: nn.LayerNorm | None = None
        self.conv_shortcut: nn.Module | None = None
        if cin != cout:
            self.norm3 = nn.LayerNorm(cin, eps=spec.eps)
            if spec.plain_shortcut:
                self.conv_shortcut = nn.Conv3d(cin, cout, 1)
            else:
                self.conv_shortcut = EdgeFramePadConv3d(cin, cout, 1, spec.causal)

    def forward(self, x: Tensor, s: EncodeChunkState | None = None) -> Tensor:
        h = self.conv1(self.nonlinearity(self.norm1(x)), s)
        h = self.conv2(self.nonlinearity(self.norm2(h)), s)
        if self.norm3 is not None:
            x = self.norm3(x.movedim(1, -1)).movedim(-1, 1)
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return h + x


def space_to_depth(x: Tensor, stride: tuple[int, int, int]) -> Tensor:
    """[B, c, T, H, W] -> [B, c*st*sh*sw, T/st, H/sh, W/sw]; channel order (c, dt, dy, dx)."""
    b, c, t, h, w = x.shape
    st, sh, sw = stride
    x = x.reshape(b, c, t // st, st, h // sh, sh, w // sw, sw).permute(0, 1, 3, 5, 7, 2, 4, 6)
    return x.reshape(b, c * st * sh * sw, t // st, h // sh, w // sw)


class SpaceToDepthDownsampler(nn.Module):
    """Conv to ``cout / prod(stride)`` channels, then space-to-depth; plus the input's own
    space-to-depth averaged over groups of channels. The first ``stride_t - 1`` frames are
    repeated in front so that ``1 + st*k`` frames give ``1 + k``."""

    def __init__(self, cin: int, cout: int, stride: tuple[int, int, int], spec: EncoderSpec):
        super().__init__()
        self.stride = stride
        self.group = cin * stride[0] * stride[1] * stride[2] // cout
        width = cout // (stride[0] * stride[1] * stride[2])
        self.conv = _conv(cin, width, spec)

    def forward(self, x: Tensor, s: EncodeChunkState | None = None) -> Tensor:
        if s is None or s.first_call(self):  # chunks after the first are whole groups
            x = torch.cat([x[:, :, : self.stride[0] - 1], x], 2)
        skip = space_to_depth(x, self.stride)
        skip = skip.unflatten(1, (-1, self.group)).mean(2)
        return space_to_depth(self.conv(x, s), self.stride) + skip


class DownBlock(nn.Module):
    def __init__(self, b: BlockSpec, spec: EncoderSpec) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(b.cin, b.cin, spec) for _ in range(b.layers))
        self.downsamplers: nn.ModuleList | None = None
        if b.downsample == "conv":
            conv = EdgeFramePadConv3d(b.cin, b.cin, 3, spec.causal, (2, 2, 2), spec.padding_mode)
            self.downsamplers = nn.ModuleList([conv])
        elif b.downsample is not None:
            stride = DOWNSAMPLE_STRIDES[b.downsample]
            self.downsamplers = nn.ModuleList(
                [SpaceToDepthDownsampler(b.cin, b.cout, stride, spec)]
            )
        self.conv_out = ResnetBlock(b.cin, b.cout, spec) if b.conv_out else None

    def forward(self, x: Tensor, s: EncodeChunkState | None = None) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x, s)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x, s)
        if self.conv_out is not None:
            x = self.conv_out(x, s)
        return x


class MidBlock(nn.Module):
    def __init__(self, ch: int, layers: int, spec: EncoderSpec) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(ch, ch, spec) for _ in range(layers))

    def forward(self, x: Tensor, s: EncodeChunkState | None = None) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x, s)
        return x


class Patchify(nn.Module):
    """[B, c, T, H, W] -> [B, c*pt*p*p, T/pt, H/p, W/p]; channel order (c, dt, dx, dy)."""

    def __init__(self, patch: int, patch_t: int) -> None:
        super().__init__()
        self.patch, self.patch_t = patch, patch_t

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        p, pt = self.patch, self.patch_t
        x = x.reshape(b, c, t // pt, pt, h // p, p, w // p, p).permute(0, 1, 3, 7, 5, 2, 4, 6)
        return x.reshape(b, c * pt * p * p, t // pt, h // p, w // p)


class SharedLogvar(nn.Module):
    """conv_out's [mean (C), logvar (1)] -> moments [mean, logvar repeated C times]."""

    def forward(self, h: Tensor) -> Tensor:
        last = h[:, -1:]
        return torch.cat([h, last.expand(-1, h.shape[1] - 2, -1, -1, -1)], 1)


def _conv(cin: int, cout: int, spec: EncoderSpec) -> EdgeFramePadConv3d:
    return EdgeFramePadConv3d(cin, cout, 3, spec.causal, padding_mode=spec.padding_mode)


# --- the architecture ---------------------------------------------------------------------
class EncoderNet(nn.Module):
    """diffusers' ``vae.encoder``: pixels -> moments, the whole clip in one pass."""

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.patchify = Patchify(spec.patch, spec.patch_t)
        cin = spec.in_channels * spec.patch**2 * spec.patch_t
        self.conv_in = _conv(cin, spec.stem_channels, spec)
        self.down_blocks = nn.ModuleList(DownBlock(b, spec) for b in spec.blocks)
        self.mid_block = MidBlock(spec.mid_channels, spec.mid_layers, spec)
        self.norm_out = RMSNorm()
        self.conv_act = nn.SiLU()
        self.conv_out = _conv(spec.mid_channels, spec.latent_channels + 1, spec)
        self.shared_logvar = SharedLogvar()

    def forward(self, x: Tensor, s: EncodeChunkState | None = None) -> Tensor:
        """The whole clip (``s`` None), or the next chunk of a causal stream ``s``."""
        h = self.conv_in(self.patchify(x), s)
        for block in self.down_blocks:
            h = block(h, s)
        h = self.mid_block(h, s)
        h = self.conv_out(self.conv_act(self.norm_out(h)), s)
        return self.shared_logvar(h)
