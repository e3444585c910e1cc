"""Serving modes: how a model's resident copy on the device is built.

Every model keeps its exact float32 CPU decoder (memory-mapped from the store): the source of
truth. A *mode* is a dtype on the serving device, with or without the family's fast-path
modules (``optimize``). The copy is built on the device directly, from the reference's
tensors, so no second float32 copy is ever held in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from app.families import family
from app.families.ops import CHANNELS_LAST
from app.runtime.device import cpu_has_fast_bf16, cpu_offers_bf16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONV3D_LAYOUTS = {"NCDHW": torch.contiguous_format, "channels_last_3d": torch.channels_last_3d}


@dataclass(frozen=True)
class Mode:
    """A dtype on the device, exact (the reference's own modules) or optimized."""

    dtype: torch.dtype
    optimized: bool = True

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{'' if self.optimized else ' exact'}"


EXACT = Mode(torch.float32, optimized=False)


def candidate_modes(setting: str, device: torch.device) -> list[Mode]:
    """The modes measured for ``VAE_DTYPE=setting`` (app/runtime/selection.py serves the fastest
    that passes the gate). ``float32`` on the CPU is the exact path alone. ``auto``: on the CPU
    float32 exact, float32 fast (the family's ``optimize``: Winograd), bf16 and bf16 fast; on a
    GPU bf16 and float32 fast. The order only breaks near-ties: bf16 first where the CPU has
    native bf16 dot products (or a GPU), else float32 first. A CPU that emulates bf16
    (measured: ``device.cpu_offers_bf16``) gets the float32 candidates only."""
    if setting == "float32" and device.type == "cpu":
        return [EXACT]
    if setting != "auto":
        return [Mode(DTYPES[setting])]
    bf16 = [Mode(torch.bfloat16)]
    float32 = [Mode(torch.float32)]
    if device.type == "cpu":
        if not cpu_offers_bf16():
            return [*float32, EXACT]
        bf16.append(Mode(torch.bfloat16, optimized=False))
        float32.append(EXACT)
    return bf16 + float32 if device.type == "cuda" or cpu_has_fast_bf16() else float32 + bf16


def build(reference: nn.Module, device: torch.device, mode: Mode) -> nn.Module:
    """The resident copy of a part (a decoder or an encoder) for ``mode`` on ``device``.
    Parameters take the mode's dtype, except those the part ``keeps_float32``; buffers (latent
    statistics) stay float32, so de-normalization keeps its precision."""
    if device.type == "cpu" and mode == EXACT:
        return reference  # the exact path is served as it is
    cast = _cast_names(reference, mode.dtype)
    if mode.dtype != torch.float32 and not cast:
        raise ValueError(f"the family keeps every parameter in float32, none in {mode.dtype}")
    with torch.device("meta"):
        fast = type(reference)(reference.config)
    state = {}
    for name, tensor in reference.state_dict(keep_vars=False).items():
        dtype = mode.dtype if name in cast else tensor.dtype
        state[name] = tensor.to(device=device, dtype=dtype)
    fast.load_state_dict(state, strict=True, assign=True)
    for name, buffer in reference.named_buffers():  # non-persistent ones are not in state_dict
        if name not in state:
            _set_buffer(fast, name, buffer.to(device))
    if fast.channels_last and device.type == "cpu":  # on a GPU, cuDNN runs NCHW faster
        set_channels_last(fast)
    if device.type == "cuda":
        set_conv3d_layout(fast, family(fast.family).gpu_conv3d_layout)  # the family's choice
    if mode.optimized:
        fast.optimize()
    return fast.eval().requires_grad_(False)


def _cast_names(reference: nn.Module, dtype: torch.dtype) -> set[str]:
    """The floating parameters a copy in ``dtype`` casts: all but those the part
    ``keeps_float32`` (MiniMax-H3's norms and layer scales; its whole encoder)."""
    return {
        name
        for name, tensor in reference.named_parameters()
        if tensor.is_floating_point()
        and not (dtype != torch.float32 and reference.keeps_float32(name))
    }


def set_channels_last(part: nn.Module) -> None:
    """Lay out ``part``'s conv weights channels-last (4-D: ``channels_last``, 5-D:
    ``channels_last_3d``): oneDNN then computes each conv in that layout and hands it on, where
    from NCHW it computes channels-last and converts back (bf16 with AMX: a copy per conv)."""
    _lay_out(part, CHANNELS_LAST)


def set_conv3d_layout(part: nn.Module, layout: str) -> None:
    """Lay out every 5-D weight of ``part`` as ``layout`` (a key of ``CONV3D_LAYOUTS``)."""
    _lay_out(part, {5: CONV3D_LAYOUTS[layout]})


def _lay_out(part: nn.Module, formats: dict[int, torch.memory_format]) -> None:
    """Every parameter of ``part`` with a number of dimensions in ``formats``, in its format."""
    for param in part.parameters():
        if param.ndim in formats:
            param.data = param.data.contiguous(memory_format=formats[param.ndim])


def _set_buffer(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._buffers[leaf] = value
