"""Retry policy and the deadline of one call: which answers are retried, how long to wait
(``Retry-After``, jittered, else exponential backoff), and when to give up."""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass, field

import httpx

from vae_client.errors import DeadlineExceeded, DecodeError

RETRY_STATUS = frozenset({429, 503})  # a full queue, draining or loading: worth coming back


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from ``Retry-After`` (delta-seconds or an HTTP date); None if absent or bad."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclass(frozen=True)
class RetryPolicy:
    """``max_retries`` of 429/503 and connection failures; waits of ``Retry-After`` x
    (1 + ``jitter``·U) plus up to ``backoff`` more, so a crowd of refused callers does not
    come back in lockstep; without ``Retry-After``, exponential backoff up to ``max_backoff``."""

    max_retries: int = 5
    backoff: float = 0.25
    max_backoff: float = 30.0
    jitter: float = 0.5

    def wait(self, failed: int, retry_after: float | None) -> float | None:
        """Seconds to wait after ``failed`` attempts, or None: do not retry."""
        if failed > self.max_retries:
            return None
        if retry_after is not None and retry_after > self.max_backoff:
            return None  # longer than this client waits: say so now rather than sleep on it
        base = min(self.max_backoff, self.backoff * 2 ** (failed - 1))
        wait = retry_after if retry_after is not None else base
        return wait * (1 + random.random() * self.jitter) + random.random() * self.backoff


@dataclass
class Attempts:
    """One call's bookkeeping: attempts made, per-attempt timeout, waits, the deadline."""

    policy: RetryPolicy
    timeout_s: float
    connect_timeout_s: float
    deadline: float | None
    start: float = field(default_factory=time.monotonic)
    count: int = 0
    last_status: int | None = None
    waits: list[float] = field(default_factory=list)

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.start + self.deadline - time.monotonic()

    def timeout(self) -> httpx.Timeout:
        """The next attempt's timeout: the per-attempt one, cut to what the deadline leaves."""
        left = self.remaining()
        if left is not None and left <= 0:
            raise self.expired("before the request was sent")
        t = self.timeout_s if left is None else min(self.timeout_s, left)
        return httpx.Timeout(t, connect=min(t, self.connect_timeout_s))

    def check(self) -> None:
        """Between received chunks: a slow body still ends at the deadline."""
        left = self.remaining()
        if left is not None and left <= 0:
            raise self.expired("while receiving the response")

    def expired(self, when: str) -> DeadlineExceeded:
        spent = time.monotonic() - self.start
        return DeadlineExceeded(
            self.last_status,
            f"deadline exceeded {when} after {spent:.2f} s and {self.count} attempt(s)",
        )

    def timed_out(self, exc: Exception) -> DecodeError:
        """An httpx timeout: the deadline's if it was the deadline that cut the attempt short."""
        left = self.remaining()
        if left is not None and left <= 0.05:
            return self.expired("waiting for the server")
        return DecodeError(
            None,
            f"timed out waiting for the server ({type(exc).__name__}, timeout {self.timeout_s} s)",
        )

    def delay(self, retry_after: float | None, error: DecodeError) -> float:
        """Seconds to wait before the next attempt, or raise ``error`` / the deadline."""
        wait = self.policy.wait(self.count, retry_after)
        if wait is None:
            raise error
        left = self.remaining()
        if left is not None and wait >= left:
            raise self.expired(f"before the next attempt, due in {wait:.1f} s ({error})")
        self.waits.append(wait)
        return wait
