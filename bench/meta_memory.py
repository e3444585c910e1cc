"""Peak live tensor memory of a computation, measured on the meta device (no memory, no
arithmetic): every storage an op creates is counted from its creation until it is freed, so
the peak is what a caching allocator would have to hold at once (less its rounding, its
fragmentation and library workspaces such as cuDNN's). Weights alive before the call are
not counted: the result is the working memory of the call.

    peak = live_peak(lambda: decoder.decode(torch.empty(shape, device="meta")))

Many meta kernels are Python (slow per call), and a long video decode repeats the same few
ops on the same shapes thousands of times: an op whose outputs are fresh storages runs once
per input layout, and its later calls get empty tensors of the layout it returned (the same
storages' sizes, so the same peak). Ops that alias, mutate or draw random numbers always run.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

META = torch.device("meta")
_UNCACHED = object()  # an op call whose result layout is not reused
# a result's pytree spec and its leaves: a tensor's (shape, stride, dtype), else the value
Layout = tuple[Any, list[Any]]


class LiveStorage(TorchDispatchMode):
    """Tracks the bytes of storages created inside the mode that a tensor still refers to."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}  # storage -> tensors alive that use it
        self._layouts: dict[Any, Layout | object] = {}  # op call's input layouts -> its result's

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        key = _call_key(func, args, kwargs) if _fresh_outputs(func) else None
        layout = self._layouts.get(key, _UNCACHED) if key is not None else _UNCACHED
        if layout is _UNCACHED:
            out = func(*args, **kwargs)
            if key is not None and key not in self._layouts:
                self._layouts[key] = _result_layout(out, args, kwargs)
        else:
            out = _materialize(layout)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        if key not in self._refs:
            self._refs[key] = 0
            self.live += size
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        weakref.finalize(t, self._release, key, size)

    def _release(self, key: int, size: int) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= size


_FRESH: dict[Any, bool] = {}


def _fresh_outputs(func: Any) -> bool:
    """Whether an op's schema says it mutates nothing and returns no alias of an input, and
    it draws no random numbers: its result then depends on its inputs' layouts alone."""
    if func not in _FRESH:
        schema = func._schema
        _FRESH[func] = (
            not schema.is_mutable
            and all(r.alias_info is None for r in schema.returns)
            and torch.Tag.nondeterministic_seeded not in func.tags
        )
    return _FRESH[func]


def _key(x: Any) -> Any:
    """A hashable stand-in for an argument: a tensor by its layout, a value by itself (a
    TypeError for one that cannot be hashed)."""
    if isinstance(x, torch.Tensor):
        if x.device != META:
            raise TypeError("a tensor off the meta device: its op must run")
        return ("tensor", x.dtype, x.layout, tuple(x.shape), x.stride(), x.storage_offset())
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_key(i) for i in x))
    if isinstance(x, dict):
        return (dict, tuple((k, _key(v)) for k, v in x.items()))
    hash(x)
    return (type(x), x)  # the type too: 1, 1.0 and True are equal keys otherwise


def _call_key(func: Any, args: Any, kwargs: dict[str, Any]) -> Any | None:
    try:
        return (func, _key(args), _key(kwargs))
    except TypeError:
        return None


def _empty(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype, device=META)


def _result_layout(out: Any, args: Any, kwargs: dict[str, Any]) -> Layout | object:
    """The layout of an op's result, if empty tensors made from it hold storages of the same
    sizes: fresh meta storages, one per output tensor, none an input's."""
    leaves, spec = tree_flatten(out)
    inputs = {
        t.untyped_storage()._cdata
        for t in tree_flatten((args, kwargs))[0]
        if isinstance(t, torch.Tensor)
    }
    storages, layout = set(), []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            if not isinstance(leaf, (int, float, bool, type(None))):
                return _UNCACHED
            layout.append(leaf)
            continue
        storage = leaf.untyped_storage()
        shape, stride, dtype = tuple(leaf.shape), leaf.stride(), leaf.dtype
        remade = _empty(shape, stride, dtype)
        if (
            leaf.device != META
            or leaf.layout != torch.strided
            or leaf.storage_offset() != 0
            or storage._cdata in inputs | storages
            or storage.nbytes() != remade.untyped_storage().nbytes()
        ):
            return _UNCACHED
        storages.add(storage._cdata)
        layout.append((shape, stride, dtype))
    return spec, layout


def _materialize(layout: Layout) -> Any:
    spec, leaves = layout
    out = [_empty(*leaf) if isinstance(leaf, tuple) else leaf for leaf in leaves]
    return tree_unflatten(out, spec)


def live_peak(fn: Callable[[], Any]) -> int:
    """Peak bytes of the tensors ``fn`` creates that are alive at once (its result included)."""
    with torch.inference_mode(), LiveStorage() as mode:
        result = fn()
        peak = mode.peak
    del result
    return peak
