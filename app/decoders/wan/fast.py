"""The Wan fast path, served only behind the parity gate.

``optimize``, on every device, computes each upsampler's nearest-2x + 3x3 conv as four 2x2
convs on the low-res grid (``ops.PhaseConv``: the same sums, 4/9 of the FLOPs, no upsampled
frames). On the CPU it also
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

from app.decoders import ops, winograd
from app.decoders.wan.model import Upsampler

if TYPE_CHECKING:
    from app.decoders.wan.model import Architecture

MAX_CHANNELS = 384


def optimize(decoder: Architecture) -> None:
    cpu = decoder.conv_in.weight.device.type == "cpu"
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
