"""Operations shared by the decoder families."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn


def group_norm_silu(norm: nn.GroupNorm, x: Tensor) -> Tensor:
    """GroupNorm then SiLU, the SiLU in place on the fresh GroupNorm output (one buffer)."""
    return F.silu(norm(x), inplace=True)


def to_model(z: Tensor, weight: Tensor) -> Tensor:
    """Move a latent to the weights' device, dtype and memory format."""
    z = z.to(device=weight.device, dtype=weight.dtype)
    if weight.ndim == 4 and weight.is_contiguous(memory_format=torch.channels_last):
        z = z.contiguous(memory_format=torch.channels_last)
    return z


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
    """3x3 kernel after nearest-2x -> four 2x2 kernels, one per output phase (a, b).

    Output row 2i+a reads upsampled rows 2i+a-1..2i+a+1, i.e. low-res rows {i-1, i} for
    a=0 (kernel rows 0 | 1+2) and {i, i+1} for a=1 (kernel rows 0+1 | 2); same for columns.
    Returns [2, 2, Cout, Cin, 2, 2].
    """
    rows = (
        torch.stack([weight[:, :, 0], weight[:, :, 1] + weight[:, :, 2]], dim=2),
        torch.stack([weight[:, :, 0] + weight[:, :, 1], weight[:, :, 2]], dim=2),
    )
    phases = []
    for r in rows:
        cols = (
            torch.stack([r[..., 0], r[..., 1] + r[..., 2]], dim=-1),
            torch.stack([r[..., 0] + r[..., 1], r[..., 2]], dim=-1),
        )
        phases.append(torch.stack(cols))
    out = torch.stack(phases)
    if weight.is_contiguous(memory_format=torch.channels_last):
        out = out.contiguous(memory_format=torch.channels_last) if out.ndim == 4 else out
    return out


def upsample2x_conv3x3_phases(x: Tensor, phase_weights: Tensor, bias: Tensor | None) -> Tensor:
    """Exactly conv3x3(nearest2x(x)), computed as four 2x2 convs on the low-res grid."""
    b, _, h, w = x.shape
    xp = F.pad(x, (1, 1, 1, 1))
    cout = phase_weights.shape[2]
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and x.shape[1] > 1
    out = x.new_empty((b, cout, h, 2, w, 2))
    for a in range(2):
        for c in range(2):
            part = F.conv2d(xp[:, :, a : a + h + 1, c : c + w + 1], phase_weights[a, c], bias)
            out[:, :, :, a, :, c] = part
    out = out.view(b, cout, 2 * h, 2 * w)
    return out.contiguous(memory_format=torch.channels_last) if channels_last else out


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
