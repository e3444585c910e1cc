"""The LTX-2 video decoder, exactly: ``diffusers.AutoencoderKLLTX2Video``'s decoder half.

The same causal 3-D decoder as LTX-Video 0.9.x (``model.py``: blocks, RMSNorm over channels,
timestep modulation, noise injection, streaming) with three differences, each a layer here:

  * spatial padding: every 3x3x3 conv pads H and W with ``decoder_spatial_padding_mode``
    (``"reflect"`` in LTX-2) instead of zeros; time is padded as before (edge frames);
  * upsamplers per ``upsample_type``: ``spatiotemporal`` (2, 2, 2), ``spatial`` (1, 2, 2) or
    ``temporal`` (2, 1, 1) depth-to-space; the first ``stride_t - 1`` output frames are dropped
    (none for a spatial-only one). ``upsample_type[i]`` belongs to up block ``i`` in decode
    order (diffusers reverses every other decoder list, not this one);
  * the channel-changing resnet's shortcut is a plain 1x1 ``nn.Conv3d`` (``conv_shortcut.weight``).

RMSNorm is the shared one (statistics in float32; diffusers' ``PerChannelRMSNorm`` divides by
``sqrt`` in the input dtype: the same at float32). The config carries ``"version": "ltx2"``
(written by ``convert``); ``app.families.ltx.decoder.Decoder(config)`` then builds its network from
``ltx2_spec`` (``decode.py``). This module imports ``model`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from app.families.ltx.decoder.model import DEFAULTS as LTX_DEFAULTS
from app.families.ltx.decoder.model import (
    BlockSpec,
    DecoderSpec,
    EdgeFrameConv3d,
    Stream,
    decoder_spec,
)
from app.families.ops import conv3d

VERSION = "ltx2"
UPSAMPLE_STRIDES: dict[str, tuple[int, int, int]] = {
    "spatiotemporal": (2, 2, 2),
    "spatial": (1, 2, 2),
    "temporal": (2, 1, 1),
}
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")

# diffusers' AutoencoderKLLTX2Video defaults for the decoder half (a config.json may omit them)
DEFAULTS: dict[str, Any] = {
    "version": VERSION,
    "latent_channels": 128,
    "out_channels": 3,
    "decoder_block_out_channels": [256, 512, 1024],
    "decoder_layers_per_block": [5, 5, 5, 5],
    "decoder_spatio_temporal_scaling": [True, True, True],
    "decoder_inject_noise": [False, False, False, False],
    "upsample_type": ["spatiotemporal", "spatiotemporal", "spatiotemporal"],
    "upsample_residual": [True, True, True],
    "upsample_factor": [2, 2, 2],
    "timestep_conditioning": False,
    "patch_size": 4,
    "patch_size_t": 1,
    "resnet_norm_eps": 1e-6,
    "decoder_causal": True,
    "decoder_spatial_padding_mode": "reflect",
    "scaling_factor": 1.0,
}
# diffusers accepts a bool for these lists: (key, length relative to the number of blocks)
_BOOL_LISTS = {"decoder_spatio_temporal_scaling": 0, "decoder_inject_noise": 1}


# --- layers -------------------------------------------------------------------------------
class PaddedConv3d(EdgeFrameConv3d):
    """``EdgeFrameConv3d`` whose spatial padding is ``padding_mode`` (time: edge frames)."""

    def __init__(self, cin: int, cout: int, kernel: int, causal: bool, padding_mode: str) -> None:
        super().__init__(cin, cout, kernel, causal)
        self.padding_mode = padding_mode
        self.hw_pad = kernel // 2 if padding_mode != "zeros" else 0
        if self.hw_pad:
            self.conv.padding = (0, 0, 0)  # padded in _run instead

    def _run(self, x: Tensor) -> Tensor:
        if self.hw_pad and x.shape[2] >= self.kt:
            p = self.hw_pad
            x = F.pad(x, (p, p, p, p, 0, 0), mode=self.padding_mode)
        return super()._run(x)


class PlainConv3d(nn.Conv3d):
    """The 1x1 shortcut of a channel-changing resnet (no temporal state)."""

    def _run(self, x: Tensor) -> Tensor:
        return conv3d(x, self)


def depth_to_space(x: Tensor, stride: tuple[int, int, int]) -> Tensor:
    """[B, c*st*sh*sw, T, H, W] -> [B, c, st*T, sh*H, sw*W]; channel (c, dt, dy, dx)."""
    b, ch, t, h, w = x.shape
    st, sh, sw = stride
    c = ch // (st * sh * sw)
    x = x.reshape(b, c, st, sh, sw, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    return x.reshape(b, c, st * t, sh * h, sw * w)


class Upsampler(nn.Module):
    """Conv to ``prod(stride) / factor`` x channels, depth-to-space by ``stride``, the first
    ``stride_t - 1`` frames dropped; plus (``residual``) the input's own depth-to-space,
    repeated to the output width."""

    def __init__(self, cin: int, b: BlockSpec, spec: DecoderSpec) -> None:
        super().__init__()
        self.stride, self.residual, self.factor = b.stride, b.residual, b.factor
        self.conv = spec.conv(cin, cin * math.prod(b.stride) // b.factor, 3)

    def forward(self, x: Tensor, s: Stream) -> Tensor:
        drop = self.stride[0] - 1
        h = depth_to_space(self.conv(x, s), self.stride)
        h = s.drop_first((self, "main"), h, drop)
        if not self.residual:
            return h
        skip = depth_to_space(x, self.stride).repeat(
            1, math.prod(self.stride) // self.factor, 1, 1, 1
        )
        skip = s.drop_first((self, "skip"), skip, drop)
        return h + s.align(self, skip, h.shape[2])


# --- config -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LTX2Spec(DecoderSpec):
    padding_mode: str = "reflect"

    def conv(self, cin: int, cout: int, kernel: int) -> nn.Module:
        return PaddedConv3d(cin, cout, kernel, self.causal, self.padding_mode)

    def shortcut(self, cin: int, cout: int) -> nn.Module:
        return PlainConv3d(cin, cout, 1)

    def upsampler(self, b: BlockSpec) -> nn.Module:
        return Upsampler(b.cout * b.factor, b, self)


def normalize_config(config: dict[str, Any]) -> dict[str, Any]:
    """LTX-2 defaults filled in; diffusers' bool shorthands expanded to lists."""
    c = {**DEFAULTS, **config}
    n = len(c["decoder_block_out_channels"])
    for key, extra in _BOOL_LISTS.items():
        if isinstance(c[key], bool):
            c[key] = [c[key]] * (n + extra)
    if isinstance(c["upsample_residual"], bool):
        c["upsample_residual"] = [c["upsample_residual"]] * n
    return c


def ltx2_spec(config: dict[str, Any]) -> LTX2Spec:
    c = normalize_config(config)
    base = decoder_spec(c)
    types = list(c["upsample_type"])
    if len(types) < len(base.blocks) or any(t not in UPSAMPLE_STRIDES for t in types):
        raise ValueError(f"upsample_type {types}: one of {list(UPSAMPLE_STRIDES)} per up block")
    mode = str(c["decoder_spatial_padding_mode"])
    if mode not in PADDING_MODES:
        raise ValueError(f"decoder_spatial_padding_mode {mode!r}: one of {PADDING_MODES}")
    blocks = tuple(
        replace(b, stride=UPSAMPLE_STRIDES[t] if b.upsample else (1, 1, 1))
        for b, t in zip(base.blocks, types, strict=False)
    )
    values = {f.name: getattr(base, f.name) for f in fields(base)}
    return LTX2Spec(**{**values, "blocks": blocks}, padding_mode=mode)


def variant_spec(config: dict[str, Any]) -> tuple[dict[str, Any], DecoderSpec]:
    """A config (LTX-2's when ``"version": "ltx2"``, else LTX-Video 0.9.x's) with its
    version's defaults filled in, and the spec of its network."""
    if config.get("version") == VERSION:
        full = normalize_config(config)
        return full, ltx2_spec(full)
    full = {**LTX_DEFAULTS, **config}
    return full, decoder_spec(full)
