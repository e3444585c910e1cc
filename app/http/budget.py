"""The budget of what requests hold, all requests together (``VAE_BODIES_MB``), and each
request's share of it (a ``BodyLease``): a body as it arrives (its declared length claimed
before, while it arrives on pace: app/http/body.py), then what it was parsed into and the most
its answer can be, then the answer until it is sent (released by app/http/envelope.py)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from app.protocol import ProtocolError
from app.runtime import heap

log = logging.getLogger("app.service")
# A burst of bodies this large, once all released, gives the heap's free pages back to the
# OS: glibc keeps what a burst's chunks and parse copies left in its heap otherwise (the
# process ratcheted to GBs; with VAE_HEAP_REUSE it keeps everything until the worker idles).
TRIM_AFTER = 64 << 20


def trim_malloc(burst: int, limit: int) -> None:
    """Give the heap's free pages back to the OS, on a thread: it walks the whole heap."""

    def trim() -> None:
        heap.release()
        log.info("request bodies: %d bytes at the burst's peak of a %d-byte budget, all "
                 "released", burst, limit)  # fmt: skip

    threading.Thread(target=trim, name="malloc-trim", daemon=True).start()


class BodyBudget:
    """The bytes requests hold, all requests together: a body as it arrives (and, before
    that, the room its Content-Length claims while it arrives on pace), then what it was
    parsed into (a latent, pixels) and the most its answer can be, then the answer until it is
    sent. A burst of large uploads, a queue of small bodies that parse into large pixels, or
    slow readers of large answers hold at most ``limit`` bytes, claims included."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.claimed = 0  # declared bytes of bodies on pace, not arrived yet
        self.peak = 0  # the most held since the budget was last empty: this burst's
        self._lock = threading.Lock()

    def take(self, size: int, claim: bool = False) -> bool:
        """Hold ``size`` bytes (``claim``: claim them for a body's bytes to come) if they fit
        beside everything held and claimed."""
        with self._lock:
            if self.held + self.claimed + size > self.limit:
                return False
            if claim:
                self.claimed += size
            else:
                self.held += size
            self.peak = max(self.peak, self.held + self.claimed)
            return True

    def settle(self, size: int) -> None:
        """Claimed bytes that arrived: held now (they had their room)."""
        with self._lock:
            self.claimed -= size
            self.held += size

    def give(self, size: int, claimed: bool = False) -> None:
        with self._lock:
            if claimed:
                self.claimed -= size
            else:
                self.held -= size
            empty = self.held + self.claimed == 0
            burst = self.peak if empty else 0
            if empty:
                self.peak = 0
        if burst >= TRIM_AFTER:  # the last large body of a burst is released
            trim_malloc(burst, self.limit)


@dataclass
class BodyLease:
    """One request's share of the ``BodyBudget``; released once its answer is out, however
    it ends (``Envelope``, the outermost middleware)."""

    budget: BodyBudget
    held: int = 0
    claimed: int = 0  # its body's declared bytes still to come, while on pace

    def cover(self, size: int) -> None:
        """Hold at least ``size`` bytes: 429 when the budget cannot hold them now, 413 when it
        never could."""
        more = size - self.held
        if more > 0:
            self._take(size, more, claim=False)
        self.held = max(self.held, size)

    def claim(self, size: int) -> None:
        """Claim a declared body's ``size`` bytes before they arrive (429, 413 as ``cover``)."""
        self._take(size, size, claim=True)
        self.claimed = size

    def arrived(self, size: int) -> None:
        """``size`` more bytes of the body are in: from its claim, else taken now."""
        settled = min(size, self.claimed)
        if settled:
            self.budget.settle(settled)
            self.claimed -= settled
            self.held += settled
        if size > settled:
            self.cover(self.held + size - settled)

    def lapse(self) -> None:
        """The body fell behind its pace: it keeps what arrived, not the room it claimed."""
        claimed, self.claimed = self.claimed, 0
        if claimed:
            self.budget.give(claimed, claimed=True)

    def _take(self, size: int, more: int, claim: bool) -> None:
        """``more`` bytes of the budget (toward a request that would hold ``size``): 413 when
        it never could hold ``size``, 429 when they do not fit now."""
        limit = self.budget.limit
        if size > limit:
            raise ProtocolError(
                413,
                f"this request would hold {size} bytes, over the {limit >> 20} MiB budget of "
                "what requests hold at once (VAE_BODIES_MB)",
                f"a request that holds under {limit >> 20} MiB: fewer rows, or a smaller dtype",
            )
        if not self.budget.take(more, claim):
            raise ProtocolError(
                429,
                f"what requests hold fills the budget ({limit >> 20} MiB, VAE_BODIES_MB): this "
                f"one's {size} bytes do not fit now",
                "retry after Retry-After seconds",
            )

    def hold(self, size: int) -> None:
        """Hold exactly ``size`` bytes: more as ``cover`` takes them, less given back."""
        if size >= self.held:
            self.cover(size)
            return
        less, self.held = self.held - size, size
        self.budget.give(less)

    def release(self) -> None:
        self.lapse()
        held, self.held = self.held, 0
        if held:
            self.budget.give(held)
