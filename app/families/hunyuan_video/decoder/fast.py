"""The HunyuanVideo fast path: exact rewrites of ``model.py``, served only behind the parity gate.

``optimize`` swaps in
  * ``PhaseUpsampler``: nearest upsampling (2x in space; 2x in time but for the first frame)
    followed by the causal, replicate-padded 3x3x3 conv, computed on the low-res input as one
    small conv per output phase (2x2x2 kernels in time and space, 3x2x2 in space alone): the
    same sums in 8/27 (4/9) of the FLOPs, and no upsampled tensor;
  * on a CPU in float32, the other 3x3x3 convs of at most ``winograd_max_channels`` by
    Winograd's F(4x4, 3x3) (``winograd.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.families import ops, winograd
from app.families.hunyuan_video.decoder.model import Upsampler

if TYPE_CHECKING:
    from app.families.hunyuan_video.decoder.model import Architecture


def time_phase_weights(weight: Tensor, temporal: bool) -> list[Tensor]:
    """The time taps of the causal conv after nearest-2x in time (the first frame once).

    Upsampled frames are x0, x1, x1, x2, x2, ...; with ``x'`` = x0 followed by the input,
    output frame 0 and the odd frames 2j+1 read (x'_j, x'_{j+1}) with taps (W0+W1, W2), the
    even frames 2j+2 read (x_j, x_{j+1}) with taps (W0, W1+W2). Without time upsampling:
    the three taps unchanged."""
    if not temporal:
        return [weight]
    w0, w1, w2 = weight[:, :, 0], weight[:, :, 1], weight[:, :, 2]
    return [torch.stack([w0 + w1, w2], dim=2), torch.stack([w0, w1 + w2], dim=2)]


class PhaseUpsampler(nn.Module):
    """``model.Upsampler`` (spatial, with or without time) computed on the low-res grid."""

    def __init__(self, up: Upsampler) -> None:
        super().__init__()
        self.conv = up.conv  # kept: the same parameter names as the module it replaces
        self.temporal = up.factor_t > 1
        weight = up.conv.conv.weight.detach()
        phases = [
            ops.upsample_phase_kernels(w)
            for w in time_phase_weights(weight.to(_sum_dtype(weight)), self.temporal)
        ]  # sums at float32 or better, rounded once
        stacked = ops.laid_out_like(torch.stack(phases).to(weight.dtype), weight)
        self.register_buffer("phase_weights", stacked, persistent=False)  # [t, a, c, ...]

    def forward(self, x: Tensor) -> Tensor:
        b, _, t, h, w = x.shape
        kernels, bias = self.phase_weights, self.conv.conv.bias
        # replicate padding commutes with nearest upsampling: pad the low-res input
        xp = F.pad(x, (1, 1, 1, 1, 1 if self.temporal else 2, 0), mode="replicate")
        frames, cout = (2 * t - 1 if self.temporal else t), kernels.shape[3]
        fmt = torch.channels_last_3d if _channels_last(x) else torch.contiguous_format
        shape = (b, cout, frames, 2 * h, 2 * w)
        out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)
        grid = out.view(b, cout, frames, h, 2, w, 2)  # [.., i, a, j, c]: pixel (2i+a, 2j+c)
        pairs = grid[:, :, 1:].view(b, cout, t - 1, 2, h, 2, w, 2) if self.temporal else None
        for a in range(2):
            for c in range(2):
                src = xp[..., a : a + h + 1, c : c + w + 1]
                first = ops.conv3d_direct(src, kernels[0, a, c], bias)
                if pairs is None:
                    grid[:, :, :, :, a, :, c] = first
                    continue
                grid[:, :, 0, :, a, :, c] = first[:, :, 0]  # frame 0: x0 through all taps
                if t > 1:
                    pairs[:, :, :, 0, :, a, :, c] = first[:, :, 1:]  # frames 1, 3, ...
                    second = ops.conv3d_direct(src[:, :, 1:], kernels[1, a, c], bias)
                    pairs[:, :, :, 1, :, a, :, c] = second  # frames 2, 4, ...
        return out


def _channels_last(x: Tensor) -> bool:
    return x.shape[1] > 1 and x.is_contiguous(memory_format=torch.channels_last_3d)


def optimize(decoder: Architecture, winograd_max_channels: int) -> None:
    """Swap the fast modules in (on the served copy, after its dtype and layout are set)."""
    for block in decoder.up_blocks:
        if block.upsamplers is not None and block.upsamplers[0].factor_s > 1:
            block.upsamplers = nn.ModuleList([PhaseUpsampler(block.upsamplers[0])])
    # CPU float32 only (``winograd.suits``); not the upsamplers' convs: the phases run those
    others = [decoder.conv_in, decoder.mid_block, *(b.resnets for b in decoder.up_blocks)]
    winograd.prepare(nn.ModuleList([*others, decoder.conv_out]), max_channels=winograd_max_channels)


def _sum_dtype(weight: Tensor) -> torch.dtype:
    return torch.promote_types(weight.dtype, torch.float32)
