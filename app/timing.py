"""Per-phase timing of one request.

Decoders mark their stage boundaries with ``with timer.phase("up_0"):``; the
service turns the recorded phases into ``Server-Timing`` and the
``vae_phase_seconds`` histogram. On CUDA the phases are measured with CUDA
events (host clocks around async launches measure the launch, not the work).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Collects ``(phase, seconds)`` in order; repeated phases accumulate."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._host: dict[str, float] = {}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((name, start, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self._host[name] = self._host.get(name, 0.0) + seconds

    def phases(self) -> dict[str, float]:
        """Seconds per phase, in first-seen order (synchronizes CUDA events)."""
        out = dict(self._host)
        if self._events:
            torch.cuda.synchronize(self.device)
            for name, start, end in self._events:
                out[name] = out.get(name, 0.0) + start.elapsed_time(end) / 1000.0
            self._events.clear()
            self._host = out
        return dict(out)


class NullTimer(PhaseTimer):
    """A timer that records nothing: the default for library calls and tests."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def add(self, name: str, seconds: float) -> None:
        pass


NULL_TIMER = NullTimer()
