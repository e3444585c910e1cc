"""Per-phase timing of one request.

Host phases (parse, queue, encode) are timed with the host clock. Device phases (upload, the
decoder's stages, download) run asynchronously on a GPU, so there they are recorded as CUDA
events and turned into seconds by ``resolve``, which the decode worker calls after its own
synchronization: nothing else ever waits on the device, least of all the event loop.

Model code carries no timer. A decoder names its stage modules (``VAEDecoder.stages``);
``instrument`` hooks them once at load, and each hook records into the timer that is *active*
in the calling thread (``with timer.active():``), so the same resident module can be timed for
one request and run untimed for another (the parity gate, a test). Driver code outside the
modules (tiling, blending, streaming) uses the module-level ``phase``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

Clock = Callable[[], float]


class PhaseTimer:
    """Collects ``(phase, seconds)`` in first-seen order; repeated phases accumulate."""

    def __init__(self, clock: Clock = time.perf_counter) -> None:
        self.clock = clock
        self.device = torch.device("cpu")  # where device phases run; set by the runner
        self._seconds: dict[str, float] = {}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._open: dict[int, list] = {}  # stage module id -> its open scopes (hooks)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A host phase: wall time on the host clock."""
        self._seconds.setdefault(name, 0.0)  # ordered by first start, not first end
        t0 = self.clock()
        try:
            yield
        finally:
            self.add(name, self.clock() - t0)

    @contextmanager
    def device_phase(self, name: str) -> Iterator[None]:
        """A phase of device work: CUDA events on a GPU (resolved later), else the host clock."""
        if self.device.type != "cuda":
            with self.phase(name):
                yield
            return
        start, end = _event(), _event()
        start.record()
        try:
            yield
        finally:
            end.record()
            self._seconds.setdefault(name, 0.0)  # keeps the phase's place in the order
            self._events.append((name, start, end))

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def resolve(self) -> None:
        """Turn recorded CUDA events into seconds. Call after synchronizing the device (the
        decode worker does, once its output is on the host); an event still pending stays."""
        pending = []
        for name, start, end in self._events:
            if end.query():
                self.add(name, start.elapsed_time(end) / 1000.0)
            else:
                pending.append((name, start, end))
        self._events = pending

    def phases(self) -> dict[str, float]:
        """Seconds per phase so far, in first-seen order. Never waits on the device."""
        return dict(self._seconds)

    @contextmanager
    def active(self) -> Iterator[PhaseTimer]:
        """Make this the timer that stage hooks and ``phase`` record into, in this context."""
        token = _active.set(self)
        try:
            yield self
        finally:
            _active.reset(token)


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


_active: ContextVar[PhaseTimer | None] = ContextVar("active_timer", default=None)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """A device phase of the active timer (a no-op when none is active)."""
    timer = _active.get()
    if timer is None:
        yield
        return
    with timer.device_phase(name):
        yield


def instrument(stages: list[tuple[str, nn.Module]]) -> None:
    """Hook each named stage module so its calls are timed by the active timer. Idempotent."""
    for name, module in stages:
        if getattr(module, "_timed_stage", None) == name:
            continue
        module._timed_stage = name
        module.register_forward_pre_hook(_stage_start)
        module.register_forward_hook(_stage_end)


def _stage_start(module: nn.Module, args: tuple) -> None:
    if torch.compiler.is_compiling():  # a compiled graph is timed whole, by the runner
        return
    timer = _active.get()
    if timer is not None:
        scope = timer.device_phase(module._timed_stage)
        scope.__enter__()
        timer._open.setdefault(id(module), []).append(scope)


def _stage_end(module: nn.Module, args: tuple, output: object) -> None:
    if torch.compiler.is_compiling():
        return
    timer = _active.get()
    scopes = timer._open.get(id(module)) if timer is not None else None
    if scopes:
        scopes.pop().__exit__(None, None, None)
