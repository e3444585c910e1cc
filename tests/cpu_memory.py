"""The CPU's real peak memory of one call, and the served copies it is measured on.

The measured peak is that of PyTorch's CPU allocator: the profiler (``profile_memory=True``)
records every allocation and free made through it, inside ops too (oneDNN's blocked copies of
a conv's input and output, its re-packed weight, im2col columns, Winograd's block buffers,
SDPA's own buffers), and ``cpu_peak`` is the highest running sum of them in time order. What
exists before the call (the weights) is not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from app.runtime import modes


def cpu_peak(run: Callable[[], Any]) -> int:
    """Peak bytes of the CPU allocator's allocations made by ``run`` and alive at once (its
    result included): the running sum of the profiler's allocation events in time order."""
    with (
        torch.inference_mode(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p,
    ):
        result = run()
        del result
    events, stack = [], list(p.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


def served_zeroed(cls: type[nn.Module], config: dict[str, Any], mode: modes.Mode) -> Any:
    """The copy the service serves in ``mode`` on the CPU (``modes.build``) of a ``cls`` with
    zero weights: memory does not depend on their values, and initialising a full-size one
    takes longer than running it."""
    with torch.device("meta"):
        reference = cls(dict(config)).eval()
    reference.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in (*reference.parameters(), *reference.buffers()):
            tensor.zero_()
    return modes.build(reference, torch.device("cpu"), mode)
