"""The LTX fast path: the exact layers of ``model.py`` with their conv weights packed once.

oneDNN convolves with weights in its own blocked layout. Handed a plain ``[O, I, kt, kh, kw]``
weight (``model.conv3d``), it re-orders the weight into that layout on every call: 113 MB for a
1024-channel 3x3x3 conv, on every conv of every frame chunk. ``optimize`` packs each
``CausalConv3d``'s weight once per input shape (``mkldnn._reorder_convolution_weight``, at
the first call: the warm-up's) and runs the conv
through ``mkldnn._convolution_pointwise``, which takes the packed weight as it is: the same
convolution, summed in oneDNN's order (float32 round-off differs, within the parity gate).

Only convs whose weight outweighs their input are packed (the low-resolution, wide stages:
elsewhere packing measured slower), and only float32 on the CPU (the path ``model.conv3d`` sends to oneDNN); other dtypes
and devices keep the exact layer. The packed weights are a second copy of the conv weights
(the plain ones stay: they are the reference's, memory-mapped). Measurements:
docs/bench/ltx.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from app.decoders.ltx.model import CausalConv3d

if TYPE_CHECKING:
    from app.decoders.ltx.model import Decoder


class PackedCausalConv3d(CausalConv3d):
    """``CausalConv3d`` (same padding, same stream carry) convolving with a packed weight."""

    def __init__(self, layer: CausalConv3d) -> None:
        nn.Module.__init__(self)
        self.conv, self.kt, self.pad = layer.conv, layer.kt, layer.pad  # the same parameters
        c = self.conv
        self.args = (list(c.padding), list(c.stride), list(c.dilation), c.groups)
        self.packed: Tensor | None = None  # the weight in oneDNN's layout for ``packed_for``
        self.packed_for: tuple[int, ...] | None = None

    def _run(self, x: Tensor) -> Tensor:
        if x.shape[2] < self.kt or x.dtype != torch.float32 or x.device.type != "cpu":
            return super()._run(x)
        if self.conv.weight.numel() <= x.numel():
            # the weight is small next to the activations: its reorder is cheap, and oneDNN's
            # channels-last output (copied back below) would cost more than packing saves
            return super()._run(x)
        if self.packed is None or tuple(x.shape) != self.packed_for:
            # oneDNN's layout depends on the input's shape (packed for another shape, a
            # 512-channel conv ran 20x slower); a stream's chunks share one shape
            self.packed = None  # one packed copy at a time
            weight = self.conv.weight.detach()
            self.packed = torch.ops.mkldnn._reorder_convolution_weight(
                weight, *self.args, list(x.shape)
            )
            self.packed_for = tuple(x.shape)
        y = torch.ops.mkldnn._convolution_pointwise(
            x, self.packed, self.conv.bias, *self.args, "none", [], ""
        )
        # oneDNN writes channels-last; the layers around expect contiguous NCTHW (mixed
        # layouts make every elementwise op and the next conv's input many times slower)
        return y.contiguous()


def packable(decoder: nn.Module) -> bool:
    weight = next(decoder.parameters())
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
    )


def optimize(decoder: Decoder) -> None:
    """Swap every ``CausalConv3d`` for its packed twin (float32 CPU copies only)."""
    if not packable(decoder):
        return
    for module in list(decoder.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is CausalConv3d:
                setattr(module, child_name, PackedCausalConv3d(child))
