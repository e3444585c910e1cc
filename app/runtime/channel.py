"""The streaming channel: decoded frames from the decode worker to the MP4 encoder.

The worker must never be held by one slow reader: frames are buffered up to a byte bound, so
the worker decodes on while the encoder and the client catch up. Only when the buffer is full
does the worker wait, and only while the reader makes progress; a reader that takes nothing
for ``wait_s`` is dropped, and the worker moves on to the next job.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future

from torch import Tensor


class StreamDropped(Exception):
    """The stream was given up (reader stalled or gone): its response must be aborted."""


class FrameChannel:
    def __init__(self, max_bytes: int, wait_s: float) -> None:
        self.max_bytes = max_bytes
        self.wait_s = wait_s
        self.first: Future = Future()  # resolves with the first frames, or the error before
        self.dropped: str = ""  # why the stream was given up, once it was
        self._items: deque[Tensor] = deque()
        self._bytes = 0
        self._taken = 0  # chunks the reader has taken: its progress
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    # --- the worker's side ----------------------------------------------------------------
    def put(self, frames: Tensor) -> bool:
        """Hand frames to the reader; False when the stream was dropped (stop decoding)."""
        size = frames.numel() * frames.element_size()
        with self._cond:
            progress, deadline = self._taken, time.monotonic() + self.wait_s
            while self._items and self._bytes + size > self.max_bytes and not self.dropped:
                if self._taken != progress:  # the reader moved: give it more time
                    progress, deadline = self._taken, time.monotonic() + self.wait_s
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._drop(f"the reader took nothing for {self.wait_s:g} s")
                    break
                self._cond.wait(remaining)
            if self.dropped:
                return False
            self._items.append(frames)
            self._bytes += size
            self._cond.notify_all()
        _settle(self.first, None)
        return True

    def close(self, error: BaseException | None = None) -> None:
        """No more frames: the decode ended, or failed with ``error``."""
        with self._cond:
            self._closed, self._error = True, error
            self._cond.notify_all()
        _settle(self.first, error)

    # --- either side ----------------------------------------------------------------------
    def drop(self, reason: str) -> None:
        with self._cond:
            self._drop(reason)

    def _drop(self, reason: str) -> None:
        if not self.dropped:
            self.dropped = reason
            self._items.clear()
            self._bytes = 0
        self._cond.notify_all()

    # --- the reader's side ----------------------------------------------------------------
    def __iter__(self) -> Iterator[Tensor]:
        """Frames in order until the decode ends; its error, or StreamDropped, is raised."""
        while True:
            with self._cond:
                while not self._items and not self._closed and not self.dropped:
                    self._cond.wait(0.5)
                if self.dropped:
                    raise StreamDropped(self.dropped)
                if not self._items:
                    if self._error is not None:
                        raise self._error
                    return
                frames = self._items.popleft()
                self._bytes -= frames.numel() * frames.element_size()
                self._taken += 1
                self._cond.notify_all()
            yield frames


def _settle(future: Future, error: BaseException | None) -> None:
    """Resolve a future once, with a result or an exception."""
    if future.done() or not future.set_running_or_notify_cancel():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
