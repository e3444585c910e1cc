"""The LTX-Video fast path (LTX-2 too), served only behind the parity gate.

On a CPU in float32, ``optimize`` gives the 3x3 convs of 128 to 256 channels their Winograd
operands (``winograd.py``; ``ops.conv3d`` then runs them by F(4x4, 3x3)). The wider convs
(512 and 1024 channels, at the lowest resolutions) keep the direct kernels: their operands
would take four times their weights' memory (docs/BENCHMARKS.md) for a small share of the decode.
"""

from __future__ import annotations

from torch import nn

from app.decoders import winograd

MAX_CHANNELS = 256


def optimize(decoder: nn.Module) -> None:
    winograd.prepare(decoder, max_channels=MAX_CHANNELS)
