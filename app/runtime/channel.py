"""The streaming channel: decoded frames from the decode worker to the MP4 encoder.

The worker must never be held by one slow reader: frames are buffered up to a byte bound, so
the worker decodes on while the encoder and the client catch up. Only when the buffer is full
does the worker wait (doing other work meanwhile, through ``put``'s ``idle``), and only while
the reader makes progress; a reader that takes nothing for ``wait_s`` is dropped, and the
worker moves on to the next job.

A channel also tells when its stream no longer holds anything (``on_free``): the worker has
closed it, and its reader (the MP4 response, with its ffmpeg) has ended or will never start.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
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
        self.on_free: Callable[[], None] | None = None  # the stream's slot, given back once
        self._delivered = False  # a frame reached the buffer: a reader (response) will come
        self._reader = ""  # "" (none yet), "attached" or "done"

    def _free_if_done(self) -> None:
        """Under the lock: give the slot back once the worker is done and the reader is done or
        will never come (no frame reached it, or the stream was dropped before it attached)."""
        if not self._closed:
            return
        no_reader = not self._delivered or (self.dropped and not self._reader)
        if self._reader != "done" and not no_reader:
            return
        on_free, self.on_free = self.on_free, None
        if on_free is not None:
            on_free()

    # --- the worker's side ----------------------------------------------------------------
    def put(self, frames: Tensor, idle: Callable[[], bool] | None = None) -> bool:
        """Hand frames to the reader; False when the stream was dropped (stop decoding).

        While the buffer is full, ``idle()`` is called to do other work (it says whether it
        did any); without it, or with nothing to do, the worker waits for the reader."""
        size = frames.numel() * frames.element_size()
        progress, deadline = self._taken, time.monotonic() + self.wait_s
        while True:
            with self._cond:
                if self.dropped:
                    return False
                if not self._items or self._bytes + size <= self.max_bytes:
                    self._items.append(frames)
                    self._bytes += size
                    self._delivered = True
                    self._cond.notify_all()
                    break
                if self._taken != progress:  # the reader moved: give it more time
                    progress, deadline = self._taken, time.monotonic() + self.wait_s
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._drop(f"the reader took nothing for {self.wait_s:g} s")
                    return False
                if idle is None:
                    self._cond.wait(remaining)
                    continue
            if not idle():
                with self._cond:
                    self._cond.wait(min(remaining, 0.05))  # short: new work may arrive
        _settle(self.first, None)
        return True

    def close(self, error: BaseException | None = None) -> None:
        """No more frames: the decode ended, or failed with ``error`` (or never started)."""
        with self._cond:
            self._closed, self._error = True, error
            self._cond.notify_all()
            self._free_if_done()
        _settle(self.first, error)

    # --- the reader's side ----------------------------------------------------------------
    def attach_reader(self) -> None:
        """A response now reads this stream: the slot is held until ``reader_done``."""
        with self._cond:
            self._reader = self._reader or "attached"

    def reader_done(self) -> None:
        """The response ended and its encoder is gone: what the reader held is free."""
        with self._cond:
            self._reader = "done"
            self._drop("the response ended")
            self._free_if_done()

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
