"""The FLUX fast path: exact rewrites of ``model.py``, served only behind the parity gate.

``optimize`` swaps in:
  * ``PhaseUpsample``: nearest-2x + 3x3 conv as four 2x2 convs on the low-res grid (the same
    sums, 4/9 of the FLOPs, no upsampled tensor);
  * in-place SiLU (each SiLU reads a fresh GroupNorm output: one buffer instead of two);
  * on a CPU in float32, the resnets' 3x3 convs by Winograd's F(4x4, 3x3) (``winograd.py``):
    16/36 of their GEMM work, not exact but within about 1e-7 of the reference.

``decode_banded`` runs the same modules with every full-resolution layer a band of rows at a
time. GroupNorm statistics are global, so it gathers them exactly first (one read of the
input), then runs norm -> SiLU -> conv band by band with a one-row halo, writing straight into
the output: the full-size normalized / activated / upsampled tensors never exist. It is a
driver outside the modules, so it times its stages itself (``timing.phase``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from app.families import ops, winograd
from app.telemetry import timing

if TYPE_CHECKING:
    from app.families.flux.decoder.model import Architecture, MidBlock, ResnetBlock, UpBlock

ROW_BAND_BYTES = 32 << 20  # float32 temporaries per row band of the banded decode


class PhaseUpsample(nn.Module):
    """``model.Upsample`` computed as four 2x2 convs on the low-res grid (exact)."""

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        self.conv = ops.PhaseConv(conv)  # the same parameter names as the module it replaces

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


def optimize(decoder: Architecture) -> None:
    """Swap the fast modules in (on the served copy, after its dtype and memory format are
    set)."""
    for block in decoder.up_blocks:
        block.upsamplers = nn.ModuleList(PhaseUpsample(up.conv) for up in block.upsamplers)
    for module in decoder.modules():
        if isinstance(module, nn.SiLU):
            module.inplace = True
    # CPU float32 only (``suits``); not the upsamplers' convs: PhaseUpsample runs those
    for resnets in (decoder.mid_block.resnets, *(b.resnets for b in decoder.up_blocks)):
        winograd.prepare(resnets)


def decode_banded(decoder: Architecture, z: Tensor, band_bytes: int) -> Tensor:
    """``decoder(z)``, full-resolution layers a band of rows at a time (same result).

    Each stage gets its input with no other reference held here (``forward``-style calls,
    not ``Module.__call__``, which would keep it in its args), so a stage's input is freed as
    soon as the stage has consumed it.
    """
    if decoder.post_quant_conv is not None:
        z = decoder.post_quant_conv(z)
    held = [decoder.conv_in(z)]
    del z
    with timing.phase("mid"):
        held.append(_mid(decoder.mid_block, held.pop(), band_bytes))
    for i, block in enumerate(decoder.up_blocks):
        with timing.phase(f"up_{i}"):
            held.append(_up(block, held.pop(), band_bytes))
    x = held.pop()
    with timing.phase("conv_out"):
        band = _rows(x, band_bytes)
        return ops.norm_silu_conv_banded(x, decoder.conv_norm_out, decoder.conv_out, band)


def _mid(block: MidBlock, x: Tensor, band_bytes: int) -> Tensor:
    x = _resnet(block.resnets[0], x, band_bytes)
    for attn in block.attentions:
        x = attn(x)
    return _resnet(block.resnets[1], x, band_bytes)


def _up(block: UpBlock, x: Tensor, band_bytes: int) -> Tensor:
    for resnet in block.resnets:
        x = _resnet(resnet, x, band_bytes)
    for up in block.upsamplers:
        weights = getattr(up.conv, "phase_weights", None)
        if weights is None:  # an exact decoder asked for bands: rewrite on the fly
            weights = ops.upsample_conv_phase_weights(up.conv.weight)
        x = ops.upsample_conv_banded(x, weights, up.conv.bias, _rows(x, band_bytes))
    return x


def _resnet(block: ResnetBlock, x: Tensor, band_bytes: int) -> Tensor:
    """``block(x)``; conv2's output and the skip are written over h in place.

    Peak: the input and one activation (x + h), where a layer-at-a-time decode holds
    x, the normalized x, h, the normalized h, conv2's output and the sum.
    """
    h = ops.norm_silu_conv_banded(x, block.norm1, block.conv1, _rows(x, band_bytes))
    shortcut = block.conv_shortcut

    def skip(r0: int, r1: int) -> Tensor:
        rows = x[:, :, r0:r1]
        return rows if shortcut is None else shortcut(rows)

    band = _rows(h, band_bytes)
    return ops.norm_silu_conv_banded(h, block.norm2, block.conv2, band, out=h, skip=skip)


def _rows(x: Tensor, band_bytes: int) -> int:
    """Rows per band so one band's float32 temporaries take about ``band_bytes``."""
    row_bytes = x.shape[0] * x.shape[1] * x.shape[3] * 4
    return max(4, band_bytes // max(row_bytes, 1))
