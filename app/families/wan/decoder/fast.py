"""The Wan fast path, served only behind the parity gate.

``optimize``, on every device, computes each upsampler's nearest-2x + 3x3 conv as four 2x2
convs on the low-res grid (``ops.PhaseConv``: the same sums, 4/9 of the FLOPs, no upsampled
frames), and gives each RMSNorm ``ChannelsLastRMSNorm`` (on the CPU, where the channels are
innermost, its per-position scale from a fused LayerNorm's statistics). On the CPU it also
  * gives the float32 3x3 convs of 128 to 384 channels their Winograd operands
    (``winograd.py``; ``ops.conv3d`` then runs them by F(4x4, 3x3)). They take four times
    those weights' memory (docs/BENCHMARKS.md);
  * stores the other 3-D conv weights in channels_last_3d (the latent follows them:
    ``ops.to_model``; the temporal stream keeps the layout), which oneDNN runs faster than
    NCDHW. Those weights are then the copy's own: a float32 CPU copy otherwise shares the
    reference's tensors.
On a GPU nothing else changes (not measured there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from app.families import ops, winograd
from app.families.wan.decoder.model import RMSNorm, Upsampler

if TYPE_CHECKING:
    from app.families.wan.decoder.model import Architecture

MAX_CHANNELS = 384


class ChannelsLastRMSNorm(RMSNorm):
    """``RMSNorm`` with its scale from ``ops.channel_mean_square`` (the reference's where the
    channels are not innermost): two elementwise passes instead of six."""

    def __init__(self, norm: RMSNorm) -> None:
        nn.Module.__init__(self)
        self.gamma, self.scale = norm.gamma, norm.scale  # the same parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean_square = ops.channel_mean_square(x)
        if mean_square is None:
            return super().forward(x)
        # sqrt(C) / max(||x||, 1e-12), F.normalize's clamp, per position
        inverse = mean_square.sqrt_().clamp_min_(1e-12 / self.scale).reciprocal_()
        return torch.mul(x, inverse.to(x.dtype)).mul_(self.gamma)


def optimize(decoder: Architecture) -> None:
    cpu = decoder.conv_in.weight.device.type == "cpu"
    for name, norm in list(decoder.named_modules()):
        if type(norm) is RMSNorm:
            parent, _, attr = name.rpartition(".")
            setattr(decoder.get_submodule(parent), attr, ChannelsLastRMSNorm(norm))
    for up in (m for m in decoder.modules() if isinstance(m, Upsampler)):
        conv = up.resample[1]
        if cpu:  # the frames reach it channels-last (they follow the 3-D convs' layout)
            conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last)
        up.resample[0], up.resample[1] = nn.Identity(), ops.PhaseConv(conv)
    if not cpu:
        return
    winograd.prepare(decoder, max_channels=MAX_CHANNELS)
    for conv in decoder.modules():
        if isinstance(conv, nn.Conv3d) and not hasattr(conv, "winograd"):
            conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last_3d)
