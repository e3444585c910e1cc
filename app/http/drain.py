"""Graceful shutdown: SIGTERM drains accepted decodes before the server exits.

Cloud Run (and Kubernetes) send SIGTERM, then SIGKILL after a grace. On SIGTERM the service
refuses new decodes with 503, lets accepted ones finish within ``VAE_DRAIN_GRACE_S``, answers
the ones still waiting when it runs out with 503 (``expired``), then hands the signal to
uvicorn, which closes the listener, lets the answers go out, and exits. No accepted request
is left without an answer.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("app.http.drain")


@dataclass
class Drain:
    """SIGTERM handling: refuse new decodes (503), let accepted ones finish within the grace,
    answer the rest 503 when it runs out, then hand the signal to uvicorn."""

    grace_s: float
    answer_s: float = 1.0  # after the grace: time for the 503s to be written before the exit
    draining: bool = False
    active: int = 0  # decode requests accepted and not yet answered in full
    # Set when the grace runs out: handlers still waiting for a decode answer 503 at once.
    expired: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task | None = field(default=None, repr=False)

    def begin(self, forward: Callable[[bool], None]) -> None:
        """Start draining (on the event loop); a second signal forwards at once, forced."""
        if self.draining:
            forward(True)
            return
        self.draining = True
        log.info("draining %d requests (grace %.1f s)", self.active, self.grace_s)
        self._task = asyncio.ensure_future(self._finish(forward))

    async def _finish(self, forward: Callable[[bool], None]) -> None:
        deadline = time.monotonic() + self.grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            log.warning("drain grace ran out with %d requests unfinished: answering them 503",
                        self.active)  # fmt: skip
            self.expired.set()
            deadline = time.monotonic() + self.answer_s
            while self.active and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        # Not forced when every request has its answer: uvicorn then waits for the answers
        # to be written before it closes their connections.
        forward(self.active > 0)


def route_sigterm(drain: Drain) -> Callable[[], None]:
    """Send SIGTERM through ``drain`` before the server's own handler; returns an undo.

    Only the main thread can take signals: a server run from a test thread has none.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGTERM)

    def forward(force: bool) -> None:
        if not callable(previous):  # SIG_DFL / SIG_IGN: let the default happen
            signal.signal(signal.SIGTERM, previous)
            signal.raise_signal(signal.SIGTERM)
            return
        server = getattr(previous, "__self__", None)
        if force and hasattr(server, "force_exit"):
            server.force_exit = True  # uvicorn.Server: the grace is spent, skip its own wait
        previous(signal.SIGTERM, None)

    def on_sigterm(signum: int, frame: Any) -> None:
        loop.call_soon_threadsafe(drain.begin, forward)

    signal.signal(signal.SIGTERM, on_sigterm)

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, previous)

    return restore
