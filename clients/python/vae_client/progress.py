"""Progress of a video decode: the ``progress`` argument of ``decode`` and ``decode_to_file``.

``progress`` is a callable ``(frames_received, frames_in_all)``, called as the answer
arrives (see ``vae_client.answers``), or ``True`` for ``ProgressBar``: a bar on stderr,
drawn only when stderr is a terminal. The default (None) shows nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from vae_client.answers import ProgressCallback

Progress = ProgressCallback | bool | None


class ProgressBar:
    """``decoding ltx-video [#########...........] 48/121 frames  12.3 s`` on ``stream``
    (stderr), redrawn in place at most every ``interval`` seconds; nothing when the stream is
    not a terminal. ``close`` ends the line."""

    def __init__(
        self,
        label: str = "decoding",
        stream: IO[str] | None = None,
        width: int = 24,
        interval: float = 0.1,
    ) -> None:
        self.label, self.stream = label, stream if stream is not None else sys.stderr
        self.width, self.interval = width, interval
        self.enabled = _is_tty(self.stream)
        self.start, self._last, self.drawn = time.monotonic(), 0.0, False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < self.interval:
            return
        self._last = now
        fill = int(self.width * done / total) if total > 0 else 0
        bar = "#" * fill + "." * (self.width - fill)
        line = f"\r{self.label} [{bar}] {done}/{total} frames {now - self.start:6.1f} s\033[K"
        self.stream.write(line)
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def _is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


@contextmanager
def reporting(progress: Progress, label: str) -> Iterator[ProgressCallback | None]:
    """The callback one call reports to: the caller's, a ``ProgressBar`` for True (closed at
    the end of the call; None off a terminal), or None."""
    if progress is None or progress is False:
        yield None
    elif progress is True:
        bar = ProgressBar(label)
        try:
            yield bar if bar.enabled else None
        finally:
            bar.close()
    elif callable(progress):
        yield progress
    else:
        raise TypeError(f"progress is a callable (done, total), True or None; got {progress!r}")
