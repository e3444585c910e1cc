"""Peak live tensor memory of a computation, measured on the meta device (no memory, no
arithmetic): every storage an op creates is counted from its creation until it is freed, so
the peak is what a caching allocator would have to hold at once (less its rounding, its
fragmentation and library workspaces such as cuDNN's). Weights alive before the call are
not counted: the result is the working memory of the call.

    peak = live_peak(lambda: decoder.decode(torch.empty(shape, device="meta")))
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveStorage(TorchDispatchMode):
    """Tracks the bytes of storages created inside the mode that a tensor still refers to."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}  # storage -> tensors alive that use it

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
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


def live_peak(fn: Callable[[], Any]) -> int:
    """Peak bytes of the tensors ``fn`` creates that are alive at once (its result included)."""
    with torch.inference_mode(), LiveStorage() as mode:
        result = fn()
        peak = mode.peak
    del result
    return peak
