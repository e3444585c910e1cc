"""Operations shared by the decoder families."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from app.families import winograd


def fewest_cells(padding_mode: str) -> int:
    """The fewest cells along H and W a map padded by ``padding_mode`` takes: reflection needs
    two (one cell has nothing to reflect, and torch refuses it), zeros or edges one."""
    return 2 if padding_mode == "reflect" else 1


def to_model(z: Tensor, weight: Tensor) -> Tensor:
    """Move a latent to the weights' device, dtype and memory format (of a conv weight with
    a spatial kernel: a 1x1 one is contiguous in every format)."""
    z = z.to(device=weight.device, dtype=weight.dtype)
    if weight.ndim == 4 and weight.is_contiguous(memory_format=torch.channels_last):
        z = z.contiguous(memory_format=torch.channels_last)
    if weight.ndim == 5 and weight.is_contiguous(memory_format=torch.channels_last_3d):
        z = z.contiguous(memory_format=torch.channels_last_3d)
    return z


# Weight elements per input element above which PyTorch's im2col + GEMM conv beats oneDNN's:
# oneDNN re-packs the weight on every call, which dominates a wide conv on a small input
# (docs/bench/ltx.md has the measured crossover).
WEIGHT_HEAVY = 64


def conv3d(x: Tensor, conv: nn.Conv3d) -> Tensor:
    """``conv(x)``: by Winograd where the fast path prepared ``conv`` (``winograd.prepare``),
    else ``conv3d_direct`` with the module's weights and geometry."""
    if winograd.runs(x, conv):
        return winograd.conv3d(x, conv.winograd, conv.bias, conv.padding[-1])
    # functional: ``conv`` may be a Conv3d subclass whose forward calls this
    return conv3d_direct(
        x, conv.weight, conv.bias, conv.padding, conv.stride, conv.dilation, conv.groups
    )


def conv3d_direct(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    padding: tuple[int, ...] = (0, 0, 0),
    stride: tuple[int, ...] = (1, 1, 1),
    dilation: tuple[int, ...] = (1, 1, 1),
    groups: int = 1,
) -> Tensor:
    """A 3-D conv, on the CPU on the faster of two kernels for its shape: for a weight much
    larger than its input ``slow_conv3d`` (im2col + GEMM, no weight re-pack: oneDNN re-packs
    the weight on every call), else oneDNN. In float32 oneDNN is called directly: PyTorch's
    own choice goes by B*C*T*H alone, and sends short temporal chunks of the low-res, narrow
    stages to ``slow_conv3d``, several times slower there. bf16 otherwise, other dtypes and
    devices: PyTorch's own dispatch (it knows which CPUs run oneDNN's bf16 kernels)."""
    cpu = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
    if cpu and torch.backends.mkldnn.enabled and groups == 1:
        pad, stride, dil = list(padding), list(stride), list(dilation)
        if weight.numel() > WEIGHT_HEAVY * x.numel() and dil == [1, 1, 1]:
            kernel = list(weight.shape[2:])
            return torch.ops.aten.slow_conv3d(x, weight, kernel, bias, stride, pad)
        if x.dtype == torch.float32:
            return torch.ops.aten.mkldnn_convolution(x, weight, bias, pad, stride, dil, 1)
    return F.conv3d(x, weight, bias, stride, padding, dilation, groups)


def channel_mean_square(x: Tensor) -> Tensor | None:
    """``x.float().square().mean(1, keepdim=True)`` from a fused LayerNorm's float32
    statistics (var + mean^2), or None when ``x``'s channels are not innermost in memory or
    ``x`` is not on the CPU.

    On the CPU, PyTorch's own reductions over a short innermost dim run several times slower
    than its LayerNorm, which computes these statistics in one pass (docs/BENCHMARKS.md). The
    CUDA LayerNorm refuses a float32 weight beside a bf16 input (the H200 proof, 2026-12-04),
    and the trick was never measured there: other devices take the reference's reduction."""
    last = x.movedim(1, -1)
    if x.device.type != "cpu" or not last.is_contiguous():
        return None
    c = x.shape[1]
    stats = torch.promote_types(x.dtype, torch.float32)  # a float32 weight: float32 stats
    ones = torch.ones(c, dtype=stats, device=x.device)
    _, mean, rstd = torch.native_layer_norm(last, (c,), ones, None, 0.0)
    return (rstd.pow(-2) + mean.square()).movedim(-1, 1)  # rstd = inf where var = 0


def patchify2x2(z: Tensor) -> Tensor:
    """[B, C, H, W] -> [B, 4C, H/2, W/2], channel index c*4 + dy*2 + dx."""
    b, c, h, w = z.shape
    z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return z.reshape(b, c * 4, h // 2, w // 2)


def unpatchify2x2(z: Tensor) -> Tensor:
    """Inverse of ``patchify2x2``."""
    b, c4, h, w = z.shape
    z = z.view(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return z.reshape(b, c4 // 4, h * 2, w * 2)


def unpack_tokens(z: Tensor, height: int, width: int, scale: int) -> Tensor:
    """FLUX "packed" [B, (h/2)(w/2), 4C] with pixel height/width -> [B, C, h, w]."""
    b, _, c4 = z.shape
    h, w = 2 * (height // (scale * 2)), 2 * (width // (scale * 2))
    z = z.view(b, h // 2, w // 2, c4).permute(0, 3, 1, 2)
    return unpatchify2x2(z)


def upsample_conv_phase_weights(weight: Tensor) -> Tensor:
    """``upsample_phase_kernels``, each phase in the weight's memory layout."""
    return laid_out_like(upsample_phase_kernels(weight), weight)


def upsample_phase_kernels(weight: Tensor) -> Tensor:
    """3x3 kernel after nearest-2x -> four 2x2 kernels, one per output phase (a, b).

    Output row 2i+a reads upsampled rows 2i+a-1..2i+a+1, i.e. low-res rows {i-1, i} for
    a=0 (kernel rows 0 | 1+2) and {i, i+1} for a=1 (kernel rows 0+1 | 2); same for columns.
    The last two dims are the 3x3 (a 3-D kernel keeps its time taps).
    Returns [2, 2, Cout, Cin, (kt,) 2, 2], contiguous.
    """
    rows = (
        torch.stack([weight[..., 0, :], weight[..., 1, :] + weight[..., 2, :]], dim=-2),
        torch.stack([weight[..., 0, :] + weight[..., 1, :], weight[..., 2, :]], dim=-2),
    )
    phases = []
    for r in rows:
        cols = (
            torch.stack([r[..., 0], r[..., 1] + r[..., 2]], dim=-1),
            torch.stack([r[..., 0] + r[..., 1], r[..., 2]], dim=-1),
        )
        phases.append(torch.stack(cols))
    return torch.stack(phases)


# the channels-last memory format of a conv weight (or map), by its number of dimensions
CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def laid_out_like(kernels: Tensor, weight: Tensor) -> Tensor:
    """``kernels`` [..., Cout, Cin, *k], each kernel channels-last where ``weight`` is (else
    every conv call reorders it)."""
    fmt = CHANNELS_LAST.get(weight.ndim)
    if fmt is None or weight.shape[1] == 1 or not weight.is_contiguous(memory_format=fmt):
        return kernels
    lead, k = kernels.ndim - weight.ndim, weight.ndim - 2
    cin = lead + 1
    laid = kernels.new_empty(
        kernels.shape[:cin] + kernels.shape[cin + 1 :] + kernels.shape[cin : cin + 1]
    )
    order = [*range(cin), kernels.ndim - 1, *range(cin, cin + k)]
    return laid.permute(order).copy_(kernels)


class PhaseConv(nn.Module):
    """A 3x3 conv (padding 1) of ``nearest2x(x)``, given ``x``: four 2x2 convs on the low-res
    grid (``upsample2x_conv3x3_phases``). It holds the conv's own parameters (the same names),
    and is swapped in for a conv whose upsampling before it is swapped out."""

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        self.weight = conv.weight
        self.register_parameter("bias", conv.bias)
        weights = upsample_conv_phase_weights(conv.weight.detach())
        self.register_buffer("phase_weights", weights, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return upsample2x_conv3x3_phases(x, self.phase_weights, self.bias)


def upsample2x_conv3x3_phases(x: Tensor, phase_weights: Tensor, bias: Tensor | None) -> Tensor:
    """Exactly conv3x3(nearest2x(x)), computed as four 2x2 convs on the low-res grid."""
    return upsample_phases_padded(F.pad(x, (1, 1, 1, 1)), phase_weights, bias)


def upsample_phases_padded(xp: Tensor, phase_weights: Tensor, bias: Tensor | None) -> Tensor:
    """``xp``: low-res rows with one row/column of context (or zero pad) on every side.

    Output pixel (2i+a, 2j+c) is phase (a, c)'s pixel (i, j): each phase's conv output is
    written once, straight into its strided place in the output's own memory layout
    (channels-last input, channels-last output), never gathered by a copy afterwards."""
    b, _, hp, wp = xp.shape
    h, w, cout = hp - 2, wp - 2, phase_weights.shape[2]
    channels_last = xp.is_contiguous(memory_format=torch.channels_last) and xp.shape[1] > 1
    if channels_last:  # memory [b, h, a, w, c, cout]: NHWC of the 2x image
        out = xp.new_empty((b, h, 2, w, 2, cout))
    else:  # memory [b, cout, h, a, w, c]: NCHW of the 2x image
        out = xp.new_empty((b, cout, h, 2, w, 2))
    for a in range(2):
        for c in range(2):
            part = F.conv2d(xp[:, :, a : a + h + 1, c : c + w + 1], phase_weights[a, c], bias)
            if channels_last:
                out[:, :, a, :, c] = part.permute(0, 2, 3, 1)
            else:
                out[:, :, :, a, :, c] = part
    if channels_last:
        return out.view(b, 2 * h, 2 * w, cout).permute(0, 3, 1, 2)
    return out.view(b, cout, 2 * h, 2 * w)


# --- banded execution: full-resolution layers a band of rows at a time ---------------
#
# GroupNorm statistics are global, so a decode cut into tiles either blends seams or
# gathers the statistics exactly. The banded path gathers them (one read of the input),
# then runs norm -> SiLU -> conv a band of rows at a time with a one-row halo, writing
# straight into the output: the full-size normalized / activated / upsampled tensors
# that a layer-at-a-time decode materializes never exist.


def group_norm_affine(x: Tensor, norm: nn.GroupNorm, band: int) -> tuple[Tensor, Tensor]:
    """Per-(batch, channel) float32 scale and shift equal to ``norm`` over all of ``x``."""
    b, c, h, w = x.shape
    g = norm.num_groups
    s1 = torch.zeros(b, c, dtype=torch.float64, device=x.device)
    s2 = torch.zeros_like(s1)
    for r0 in range(0, h, band):
        xb = x[:, :, r0 : r0 + band].float()
        s1 += xb.sum(dim=(2, 3), dtype=torch.float64)
        s2 += xb.square().sum(dim=(2, 3), dtype=torch.float64)
    n = (c // g) * h * w
    mean = s1.view(b, g, -1).sum(-1) / n
    var = (s2.view(b, g, -1).sum(-1) / n - mean.square()).clamp_min(0)
    rstd = torch.rsqrt(var + norm.eps)
    rstd_c = rstd.repeat_interleave(c // g, dim=1).float()
    mean_c = mean.repeat_interleave(c // g, dim=1).float()
    scale = rstd_c * norm.weight.float()
    shift = norm.bias.float() - mean_c * scale
    return scale[:, :, None, None], shift[:, :, None, None]


def _halo(x: Tensor, r0: int, r1: int, pad: int) -> tuple[Tensor, int, int]:
    """Rows [r0-pad, r1+pad) of x clipped to the image, and the zero rows missing above/below."""
    h = x.shape[2]
    a, b = max(0, r0 - pad), min(h, r1 + pad)
    return x[:, :, a:b], pad - (r0 - a), pad - (b - r1)


def norm_silu_conv_banded(
    x: Tensor,
    norm: nn.GroupNorm,
    conv: nn.Conv2d,
    band: int,
    out: Tensor | None = None,
    skip: Callable[[int, int], Tensor] | None = None,
) -> Tensor:
    """``out = conv(silu(norm(x))) [+ skip(r0, r1)]``, a band of rows at a time (norm in fp32).

    ``out`` may be ``x`` itself (same channels): each band's last input rows are kept before
    the band is overwritten, so the next band still reads the original values.
    """
    scale, shift = group_norm_affine(x, norm, band)
    bsz, _, h, w = x.shape
    pad = conv.kernel_size[0] // 2
    in_place = out is x
    if out is None:
        out = torch.empty(
            (bsz, conv.out_channels, h, w), dtype=x.dtype, device=x.device, memory_format=_format(x)
        )
    kept: Tensor | None = None  # in place: the original rows just above this band
    for r0 in range(0, h, band):
        r1 = min(h, r0 + band)
        rows, top, bottom = _halo(x, r0, r1, pad)
        if kept is not None:
            rows, top = torch.cat([kept, x[:, :, r0 : min(h, r1 + pad)]], dim=2), 0
        act = F.silu(torch.addcmul(shift, rows.float(), scale), inplace=True).to(x.dtype)
        if in_place and pad:
            kept = x[:, :, r1 - pad : r1].clone()
        if top or bottom:  # zero rows only at the image's edges; columns via the conv's padding
            act = F.pad(act, (0, 0, top, bottom))
        y = winograd.conv_rows(conv, act)
        if skip is not None:
            y += skip(r0, r1)
        out[:, :, r0:r1] = y
    return out


def upsample_conv_banded(
    x: Tensor, phase_weights: Tensor, bias: Tensor | None, band: int
) -> Tensor:
    """conv3x3(nearest2x(x)) a band of low-res rows at a time, via the 4-phase rewrite."""
    bsz, _, h, w = x.shape
    out = torch.empty(
        (bsz, phase_weights.shape[2], 2 * h, 2 * w),
        dtype=x.dtype,
        device=x.device,
        memory_format=_format(x),
    )
    for r0 in range(0, h, band):
        r1 = min(h, r0 + band)
        rows, top, bottom = _halo(x, r0, r1, 1)
        out[:, :, 2 * r0 : 2 * r1] = upsample_phases_padded(
            F.pad(rows, (1, 1, top, bottom)), phase_weights, bias
        )
    return out


def _format(x: Tensor) -> torch.memory_format:
    cl = x.is_contiguous(memory_format=torch.channels_last) and x.shape[1] > 1
    return torch.channels_last if cl else torch.contiguous_format


def read_safetensors_folder(folder: Path) -> dict[str, Tensor]:
    """Every tensor of a diffusers model folder (single or sharded safetensors)."""
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors weights (pickle is not read)")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def cosine(a: Tensor, b: Tensor) -> float:
    """Cosine of two tensors, flattened, in float64."""
    a, b = a.detach().double().flatten().cpu(), b.detach().double().flatten().cpu()
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-300))
