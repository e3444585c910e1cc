"""3x3 convolution by Winograd's minimal filtering F(4x4, 3x3), for CPU float32 copies.

A direct 3x3 conv spends 9 multiply-adds per input channel, output channel and output pixel.
F(4x4, 3x3) (Lavin & Gray, 2016) gets each 4x4 output tile from a 6x6 input tile with 36:
transform the input tile (a few adds), 36 independent GEMMs over channels (``bmm``),
transform back (a few adds). The GEMM work is 36/144 of the direct conv's. The transforms
are memory traffic, so the work goes a block of tile rows (of every frame of a clip) at a
time, keeping every temporary in the CPU's last-level cache. A 3-D conv with a 3x3 spatial
kernel is the sum over its temporal taps of 2-D ones: one GEMM per tap over the block.

Why by hand: PyTorch's CPU convolutions on AVX2 machines are direct or im2col (oneDNN,
slow_conv2d), and the NNPACK Winograd compiled into the wheel fails to initialize on these
hosts. The result is not bit-exact (another summation order, with transforms that lose a
little float32 precision), so it is served only behind the parity gate.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# G of F(4, 3): the 6x6 transformed filter of each (out, in) channel pair is G w G^T.
# The input transform B^T and output transform A^T are written out in _input_1d / _output_1d.
_G = (
    (1 / 4, 0, 0),
    (-1 / 6, -1 / 6, -1 / 6),
    (-1 / 6, 1 / 6, -1 / 6),
    (1 / 24, 1 / 12, 1 / 6),
    (1 / 24, -1 / 12, 1 / 6),
    (0, 0, 1),
)
TILE = 4  # output pixels per tile side; input tiles are TILE + 2 wide and overlap by 2
# The transformed input of one block takes about this many bytes (its GEMM output as much):
# small enough to stay in a last-level cache, large enough to keep the GEMMs efficient.
TRANSFORMED_BLOCK_BYTES = 16 << 20


def transform_weight(weight: Tensor) -> Tensor:
    """``[out, in, 3, 3]`` or ``[out, in, kt, 3, 3]`` -> ``[kt, 36, in, out]``: per temporal
    tap, one GEMM operand per tile position."""
    w = weight if weight.ndim == 5 else weight.unsqueeze(2)
    cout, cin, kt = w.shape[:3]
    g = torch.tensor(_G, dtype=weight.dtype, device=weight.device)
    pairs = w.permute(2, 3, 4, 1, 0).reshape(kt, 3, 3, cin * cout)  # [t, k, l, (in, out)]
    u = torch.einsum("ak,tklz,bl->tabz", g, pairs, g)  # float32 is exact to a few 1e-8 here
    return u.reshape(kt, 36, cin, cout).contiguous()


def conv3x3(x: Tensor, u: Tensor, bias: Tensor | None, pad_rows: int = 1) -> Tensor:
    """``F.conv2d(x, w, bias, padding=(pad_rows, 1))`` for ``u = transform_weight(w)``.

    ``x``: ``[b, c, h, w]``, best channels-last (the output is); ``pad_rows`` 0 takes rows that
    already carry their one-row halo (a band of a larger image).
    """
    b, _, h, w = x.shape
    out_h = h + 2 * pad_rows - 2
    out = torch.empty(
        (b, u.shape[-1], out_h, w),
        dtype=x.dtype,
        device=x.device,
        memory_format=torch.channels_last,
    )
    for i in range(b):
        _frames(x[i].permute(1, 2, 0)[None], u, bias, (pad_rows, 1), out[i].permute(1, 2, 0)[None])
    return out


def conv3d(x: Tensor, u: Tensor, bias: Tensor | None, padding: int = 1) -> Tensor:
    """``F.conv3d(x, w, bias, padding=(0, padding, padding))`` for ``u = transform_weight(w)``:
    a 3x3 spatial kernel (``padding`` 1 or 0) with any number of temporal taps (temporal
    padding is the caller's). The output has the input's memory format; the work is done
    channels-last-3d.
    """
    b, _, t, h, w = x.shape
    fmt = torch.channels_last_3d
    cl = x.is_contiguous(memory_format=fmt)
    src = x if cl else x.contiguous(memory_format=fmt)
    shape = (b, u.shape[-1], t - u.shape[0] + 1, h + 2 * padding - 2, w + 2 * padding - 2)
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    for i in range(b):
        pad = (padding, padding)
        _frames(src[i].permute(1, 2, 3, 0), u, bias, pad, out[i].permute(1, 2, 3, 0))
    return out if cl else out.contiguous()


def _frames(x: Tensor, u: Tensor, bias: Tensor | None, pad: tuple[int, int], out: Tensor) -> None:
    """One clip, ``[t, h, w, c]`` views in and out: output frame f sums the 2-D convs of
    input frames f .. f + kt - 1 with the kernel's kt temporal taps (kt = 1: an image).

    Work goes a block at a time: ``rows`` tile rows of ``group`` output frames, so that the
    GEMM of each temporal tap covers the whole block (frames x tiles) in one ``bmm``.
    """
    kt, c, (frames, out_h, w, cout) = u.shape[0], x.shape[3], out.shape
    tiles_y, tiles_x = math.ceil(out_h / TILE), math.ceil(w / TILE)
    whole = out_h == TILE * tiles_y and w == TILE * tiles_x
    # Sizes that are not whole tiles are computed padded with zeros, then cropped.
    target = out if whole else x.new_empty((frames, TILE * tiles_y, TILE * tiles_x, cout))
    frame_tiles = target.view(frames, tiles_y, TILE, tiles_x, TILE, cout)
    n, group = _block(tiles_y, tiles_x, frames, kt, 36 * c * x.element_size())
    span = group + kt - 1  # input frames of a block
    rows_flat = x.new_empty(span * (TILE * n + 2) * (TILE * tiles_x + 2) * c)
    t_flat = x.new_empty(6 * span * n * (TILE * tiles_x + 2) * c)
    v_flat = x.new_empty(36 * span * n * tiles_x * c)
    m_flat = x.new_empty(36 * group * n * tiles_x * cout)
    s = x.new_empty((TILE, 6, group, n, tiles_x, cout))
    tmp = x.new_empty((2, 6, group, n, tiles_x, cout))
    for y0 in range(0, tiles_y, n):
        k = min(n, tiles_y - y0)
        for f0 in range(0, frames, group):
            g = min(group, frames - f0)
            fin = g + kt - 1
            rows = rows_flat[: fin * (TILE * k + 2) * (TILE * tiles_x + 2) * c]
            rows = rows.view(fin, TILE * k + 2, TILE * tiles_x + 2, c)
            t = t_flat[: 6 * fin * k * (TILE * tiles_x + 2) * c]
            t = t.view(6, fin, k, TILE * tiles_x + 2, c)
            v = v_flat[: 36 * fin * k * tiles_x * c].view(6, 6, fin, k, tiles_x, c)
            _load_rows(x[f0 : f0 + fin], rows, TILE * y0 - pad[0], pad[1])
            _input_1d(_taps(rows, 1, k), t)
            for a in range(6):
                _input_1d(_taps(t[a], 2, tiles_x), v[a])
            m = m_flat[: 36 * g * k * tiles_x * cout].view(36, g * k * tiles_x, cout)
            v = v.view(36, g + kt - 1, k * tiles_x, c)
            for j in range(kt):  # output frame f takes input frame f + j with tap j
                vj = v[:, j : j + g].reshape(36, g * k * tiles_x, c)
                if j == 0:
                    torch.bmm(vj, u[0], out=m)
                else:
                    m.baddbmm_(vj, u[j])
            m = m.view(6, 6, g, k, tiles_x, cout)
            if bias is not None:  # A^T's column 1 is all ones: (1, 1) adds to every pixel
                m[1, 1].add_(bias)
            block = frame_tiles[f0 : f0 + g, y0 : y0 + k]
            _output_2d(m, s[:, :, :g, :k], tmp[:, :, :g, :k], block)
    if not whole:
        out.copy_(target[:, :out_h, :w])


def _block(tiles_y: int, tiles_x: int, frames: int, kt: int, tile_bytes: int) -> tuple[int, int]:
    """(tile rows, output frames) per block: transformed input within ``TRANSFORMED_BLOCK_BYTES``, whole
    frames first (the GEMMs then span every frame), down to one tile row of ``kt`` frames."""
    row_bytes = tiles_x * tile_bytes  # one tile row of one frame, transformed
    n = TRANSFORMED_BLOCK_BYTES // ((frames + kt - 1) * row_bytes)
    if n >= 1:
        return min(n, tiles_y), frames
    return 1, max(1, TRANSFORMED_BLOCK_BYTES // row_bytes - kt + 1)


def _output_2d(m: Tensor, s: Tensor, tmp: Tensor, tiles: Tensor) -> None:
    """A^T m A: ``m`` ``[6, 6, *batch]`` into ``tiles`` ``[frames, k, TILE, tx, TILE, cout]``."""
    _output_1d(list(m), s, tmp)
    for p in range(TILE):
        _output_1d(list(s[p]), [tiles[:, :, p, :, q] for q in range(TILE)], tmp[:, 0])


def _load_rows(x: Tensor, rows: Tensor, r0: int, c0: int) -> None:
    """Rows ``[r0, r0 + n)`` of frames x (``[f, h, w, c]``) into ``rows[:, :, c0 : c0 + w]``
    (``[f, n, w', c]``), zeros around them (the conv's padding and whole-tile padding)."""
    h, w = x.shape[1:3]
    a, b = max(r0, 0), min(r0 + rows.shape[1], h)
    rows[:, : max(a - r0, 0)].zero_()
    rows[:, max(b - r0, 0) :].zero_()
    rows[:, :, :c0].zero_()
    rows[:, :, c0 + w :].zero_()
    rows[:, a - r0 : b - r0, c0 : c0 + w].copy_(x[:, a:b])


def _taps(x: Tensor, dim: int, tiles: int) -> list[Tensor]:
    """Element k (0..5) of every 6-wide input tile along ``dim`` (tiles start TILE apart)."""
    every_tile = (slice(None),) * dim + (slice(None, None, TILE),)
    return [x.narrow(dim, k, TILE * (tiles - 1) + 1)[every_tile] for k in range(6)]


def _input_1d(d: list[Tensor], out: Tensor) -> None:
    """``out[a] = sum_k B^T[a, k] d[k]`` for F(4, 3)'s B^T, in 16 passes.

    B^T rows: (4 0 -5 0 1 0), (0 -4 -4 1 1 0), (0 4 -4 -1 1 0),
              (0 -2 -1 2 1 0), (0 2 -1 -2 1 0), (0 4 0 -5 0 1).
    """
    d0, d1, d2, d3, d4, d5 = d
    torch.add(d4, d0, alpha=4, out=out[0]).add_(d2, alpha=-5)
    torch.add(d5, d1, alpha=4, out=out[5]).add_(d3, alpha=-5)
    torch.add(d1, d2, out=out[2])
    torch.add(d3, d4, out=out[1]).add_(out[2], alpha=-4)  # (d3 + d4) - 4 (d1 + d2)
    torch.sub(d1, d2, out=out[2]).mul_(4).add_(d4).sub_(d3)  # 4 (d1 - d2) + (d4 - d3)
    torch.sub(d4, d2, out=out[3])  # p
    torch.sub(d3, d1, out=out[4])  # q
    out[3].add_(out[4], alpha=2)  # p + 2q
    out[4].mul_(-4).add_(out[3])  # p + 2q - 4q = p - 2q


def _output_1d(m: list[Tensor], out: list[Tensor] | Tensor, tmp: Tensor) -> None:
    """``out[p] = sum_a A^T[p, a] m[a]`` for F(4, 3)'s A^T, in 10 passes (``tmp``: 2 buffers).

    A^T rows: (1 1 1 1 1 0), (0 1 -1 2 -2 0), (0 1 1 4 4 0), (0 1 -1 8 -8 1).
    """
    m0, m1, m2, m3, m4, m5 = m
    s12, s34 = tmp[0], tmp[1]
    torch.add(m1, m2, out=s12)
    torch.add(m3, m4, out=s34)
    torch.add(s12, s34, out=out[0]).add_(m0)
    torch.add(s12, s34, alpha=4, out=out[2])
    d12, d34 = torch.sub(m1, m2, out=s12), torch.sub(m3, m4, out=s34)
    torch.add(d12, d34, alpha=2, out=out[1])
    torch.add(d12, d34, alpha=8, out=out[3]).add_(m5)


class WinogradConv2d(nn.Conv2d):
    """A 3x3 / stride 1 / padding 1 ``nn.Conv2d``, the same parameters, run by ``conv3x3``."""

    def forward(self, x: Tensor) -> Tensor:
        if runs(x, self):
            return conv3x3(x, self.winograd, self.bias)
        return super().forward(x)


def prepare(model: nn.Module, min_channels: int = 128, max_channels: int | None = None) -> None:
    """Give every conv of ``model`` that ``suits`` its transformed weight (a ``winograd``
    buffer, not saved: four times the weight's size); 2-D ones become ``WinogradConv2d``,
    3-D ones are run by ``ops.conv3d``. Parameters and their names stay."""
    for conv in model.modules():
        if suits(conv, min_channels, max_channels):
            u = transform_weight(conv.weight.detach())
            conv.register_buffer("winograd", u, persistent=False)
            if isinstance(conv, nn.Conv2d):
                conv.__class__ = WinogradConv2d


def runs(x: Tensor, conv: nn.Module) -> bool:
    """Whether ``conv`` has a transformed weight for ``x``, and no gradient is wanted (the
    ``out=`` ops record none)."""
    if getattr(conv, "winograd", None) is None or x.device.type != "cpu":
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or conv.weight.requires_grad))


def conv_rows(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """``conv`` over rows that already carry their halo: padding only in width."""
    if runs(x, conv):
        return conv3x3(x, conv.winograd, conv.bias, pad_rows=0)
    return F.conv2d(x, conv.weight, conv.bias, padding=(0, conv.padding[1]))


def suits(conv: nn.Module, min_channels: int = 128, max_channels: int | None = None) -> bool:
    """Whether ``conv`` is a plain float32 CPU conv with a 3x3 spatial kernel, stride 1, no
    temporal padding, wide enough to gain (and, with ``max_channels``, narrow enough for
    the transformed weight's memory)."""
    # 3-D subclasses pad in time themselves, then call ops.conv3d; 2-D ones are left alone
    if not (type(conv) is nn.Conv2d or isinstance(conv, nn.Conv3d)):
        return False
    spatial = conv.kernel_size[-2:] == (3, 3) and conv.padding[-1] in (0, 1)
    if isinstance(conv, nn.Conv3d):
        spatial = spatial and conv.padding[0] == 0 and conv.padding[1] == conv.padding[2]
    else:
        spatial = spatial and conv.padding == (1, 1)
    channels = min(conv.in_channels, conv.out_channels) >= min_channels
    if max_channels is not None:
        channels = channels and max(conv.in_channels, conv.out_channels) <= max_channels
    return (
        spatial
        and channels
        and all(v == 1 for v in (*conv.stride, *conv.dilation, conv.groups))
        and conv.padding_mode == "zeros"
        and conv.weight.dtype == torch.float32
        and conv.weight.device.type == "cpu"
    )
