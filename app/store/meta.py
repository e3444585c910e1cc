"""A config checked against its weights on the meta device, before anything is built."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from app.store.files import StoreError


def meta_module(build: Callable[[], nn.Module], what: str, tensors: int) -> nn.Module:
    """Build a module on the meta device: shapes only, no memory, however wide the config. A
    config that registers far more tensors than the weights hold (``tensors``: a layer count
    gone wrong) is stopped as it builds, before its modules cost minutes and gigabytes."""
    _count_registrations()
    _budget.left, _budget.what = 2 * tensors + 64, f"{what}: the weights hold {tensors} tensors"
    try:
        with torch.device("meta"):
            return build()
    except StoreError:
        raise
    except Exception as exc:
        raise StoreError(f"{what}: its config does not build: {exc}") from exc
    finally:
        _budget.left = None


_budget = threading.local()  # tensors a meta build in this thread may still register


@functools.cache
def _count_registrations() -> None:
    from torch.nn.modules import module as torch_module

    torch_module.register_module_parameter_registration_hook(_count_one)
    torch_module.register_module_buffer_registration_hook(_count_one)


def _count_one(module: nn.Module, name: str, value: Tensor | None) -> None:
    left = getattr(_budget, "left", None)
    if left is None or value is None:
        return
    if left <= 0:
        raise StoreError(f"{_budget.what}, its config builds far more; refused while building")
    _budget.left = left - 1


def read_header(what: str, path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype code) of a safetensors file, from its header alone."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {
                k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()
            }
    except Exception as exc:  # not a safetensors file: name the entry
        raise StoreError(f"{what}: cannot load: not a safetensors file ({exc})") from exc


def checked_meta_build(what: str, build: Callable[[], nn.Module], path: Path) -> nn.Module:
    """``build()`` on meta, checked against the weights file's header: every name and shape
    (the first mismatch is named, with the byte totals when the config builds more than the
    file holds). Nothing is allocated and only the header is read."""
    header = read_header(what, path)
    module = meta_module(build, what, len(header))
    need = sum(
        v.numel() * _dtype_bytes(header.get(k, ((), None))[1], v.element_size())
        for k, v in module.state_dict().items()
    )
    have = path.stat().st_size
    try:
        check_shapes(what, module, {k: shape for k, (shape, _) in header.items()})
    except StoreError as exc:
        if need <= have:
            raise
        size = f"{need / 1e6:.1f} MB of weights, {path.name} holds {have / 1e6:.1f} MB"
        raise StoreError(f"{exc} (the config builds {size})") from None
    return module


def check_shapes(what: str, module: nn.Module, shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse weights whose names or shapes differ from ``module``'s (built on meta)."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing, unexpected = sorted(expected.keys() - shapes), sorted(shapes.keys() - expected)
    if missing or unexpected:
        raise StoreError(
            f"{what}: weights do not fit the config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for key, shape in expected.items():
        if shapes[key] != shape:
            raise StoreError(
                f"{what}: the config gives {key} the shape {list(shape)}, the weights "
                f"{list(shapes[key])}"
            )


class PairError(StoreError):
    """An encoder whose latent is not its decoder's."""


def check_pair(what: str, decoder: nn.Module, encoder: nn.Module) -> None:
    """Refuse an encoder whose latent is not the one its decoder takes (channels, pixels per
    latent cell, frames per latent frame): its latents would decode to another size."""

    def geometry(m: Any) -> str:
        return f"{m.latent_channels} channels, x{m.spatial_scale} in space, x{m.temporal_scale} in time"

    if geometry(encoder) != geometry(decoder):
        raise PairError(
            f"{what}: the encoder's latent ({geometry(encoder)}) is not the decoder's "
            f"({geometry(decoder)}): an encoder of another model"
        )


_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}


def _dtype_bytes(code: str | None, default: int) -> int:
    """Bytes per element of a header dtype code (``default``: the meta tensor's, for a name
    the file lacks or a code not listed)."""
    return _SAFETENSORS_BYTES.get(code or "", default)


def part_class(family_key: str, part: str) -> Callable[[dict[str, Any]], nn.Module] | None:
    """The module class of a family's ``decoder`` or ``encoder``, or None where the family has
    no such part; ``KeyError`` for an unknown family."""
    from app.families import family

    described = getattr(family(family_key), part)
    return None if described is None else described.module
