"""The Wan fast path, served only behind the parity gate.

On the CPU, ``optimize`` stores the 3-D convolution weights in channels_last_3d (the latent
follows them: ``ops.to_model``; the temporal stream keeps the layout), which oneDNN runs faster
than NCDHW (docs/BENCHMARKS.md). Those weights are then the copy's own: a float32 CPU copy
otherwise shares the reference's tensors. On a GPU nothing changes (not measured there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from app.decoders.wan.model import WanDecoder


def optimize(decoder: WanDecoder) -> None:
    if decoder.conv_in.weight.device.type != "cpu":
        return
    for param in decoder.parameters():
        if param.dim() == 5:
            param.data = param.data.contiguous(memory_format=torch.channels_last_3d)
