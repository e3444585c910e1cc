"""Graceful shutdown: SIGTERM starts one deadline, ``VAE_DRAIN_GRACE_S`` away, by which the
process has exited.

Cloud Run (and Kubernetes) send SIGTERM, then SIGKILL after a grace. On SIGTERM the service
refuses new decodes with 503 and bodies still arriving with 503 at once, lets accepted work
finish until the deadline's tail, answers what is still waiting 503 (``expired``), then hands
the signal to uvicorn, which closes the listener and the connections, runs the lifespan's
shutdown and exits. Every step takes only what is left of the deadline, and a watchdog ends
the process at the deadline if anything still holds it. No accepted request is left without
an answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.media.mp4 import reap_all

log = logging.getLogger("app.http.drain")

# The deadline's tail, after the time for work: the 503s written and streams cut (an 8th of
# a grace under 8 s), uvicorn's close of the listener and connections (it polls every 0.1 s),
# the lifespan's shutdown and the exit before the watchdog's.
ANSWER_S, CLOSE_S, STOP_S = 1.0, 0.5, 0.25
MIN_GRACE_S = 1.0  # a shorter grace counts as this: the close alone needs most of it
WATCHDOG_EXIT = 128 + signal.SIGTERM  # the status a shell gives a process SIGTERM ended


@dataclass
class Drain:
    """SIGTERM handling: refuse new decodes (503), let accepted ones finish until the tail of
    the deadline, answer the rest 503, then hand the signal to uvicorn."""

    grace_s: float
    draining: bool = False
    active: int = 0  # decode requests accepted and not yet answered in full
    streams: int = 0  # of those, MP4 streams sending: their 200 has left, nothing to wait for
    # Set on SIGTERM: a body still arriving is refused 503 at once.
    began: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when the time for work runs out: handlers still waiting for a decode answer 503.
    expired: asyncio.Event = field(default_factory=asyncio.Event)
    deadline: float | None = None  # time.monotonic() by which the process has exited
    _task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def exit_s(self) -> float:
        """Seconds from SIGTERM to the exit."""
        return max(self.grace_s, MIN_GRACE_S)

    def left(self, reserve: float = 0.0) -> float | None:
        """Seconds until ``reserve`` before the deadline; None without one (no SIGTERM)."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - reserve - time.monotonic())

    def begin(self, forward: Callable[[bool], None], signalled: float | None = None) -> None:
        """Start draining (on the event loop) against the deadline counted from ``signalled``
        (the signal's time.monotonic()); a second signal forwards at once, forced."""
        if self.draining:
            forward(True)
            return
        self.draining = True
        self.deadline = (time.monotonic() if signalled is None else signalled) + self.exit_s
        self.began.set()
        log.info("draining %d requests: exit within %.1f s", self.active, self.exit_s)
        self._task = asyncio.ensure_future(self._finish(forward))

    async def _finish(self, forward: Callable[[bool], None]) -> None:
        await self._settle(min(ANSWER_S, self.exit_s / 8) + CLOSE_S + STOP_S)
        if self.active:
            log.warning("drain grace ran out with %d requests unfinished: answering them 503",
                        self.active)  # fmt: skip
            self.expired.set()  # streams are cut: their connections close with the process
            await self._settle(CLOSE_S + STOP_S, self.streams)
        # Not forced when every request has its answer: uvicorn then waits (what is left of
        # the deadline) for the answers to be written before it closes their connections.
        forward(self.active > 0)

    async def _settle(self, reserve: float, streams: int = 0) -> None:
        """Until no request is active (but ``streams`` of them), or ``reserve`` before the
        deadline."""
        while self.active - min(streams, self.streams) > 0 and self.left(reserve):
            await asyncio.sleep(0.02)


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
        config = getattr(server, "config", None)
        if hasattr(config, "timeout_graceful_shutdown"):  # uvicorn: its close, in what is left
            config.timeout_graceful_shutdown = drain.left(STOP_S)
        if force and hasattr(server, "force_exit"):
            server.force_exit = True  # uvicorn.Server: the grace is spent, skip its own wait
        previous(signal.SIGTERM, None)

    def on_sigterm(signum: int, frame: Any) -> None:
        signalled = time.monotonic()
        if not drain.draining:
            watchdog(signalled + drain.exit_s)
        loop.call_soon_threadsafe(drain.begin, forward, signalled)

    signal.signal(signal.SIGTERM, on_sigterm)

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, previous)

    return restore


def watchdog(deadline: float) -> None:
    """End the process at ``deadline`` (time.monotonic()) if it still runs then: whatever
    holds it (a blocked event loop, a thread the exit waits for), the platform's SIGKILL must
    not be what ends it."""

    def fire() -> None:
        time.sleep(max(0.0, deadline - time.monotonic()))
        log.error("still running at the shutdown deadline: exiting now")
        reap_all()  # no ffmpeg outlives the process
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(WATCHDOG_EXIT)

    threading.Thread(target=fire, name="shutdown-watchdog", daemon=True).start()
