"""What every decode and encode request goes through, whatever its body: accounting (the
drain, ``Server-Timing``, metrics and the log line), the JSON answer of a refusal, the body read
within its limit, its time and the process's budget of what requests hold (the body as it
arrives, then its parsed input and its answer, until the answer is sent), the deadline, and the
wait for the worker's outcome (a client that leaves, a deadline that passes, a drain that runs
out)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from starlette.requests import ClientDisconnect

from app.config import CLOUD_RUN_REQUEST_MB, Settings
from app.http.accounting import finisher, server_timing
from app.http.drain import Drain
from app.http.errors import (
    ANOTHER_INSTANCE,
    CLIENT_GONE,
    ClientGone,
    deadline_error,
    error_response,
    runtime_error,
)
from app.http.mp4 import JobStream
from app.http.serving import Serving
from app.protocol import Head, ProtocolError
from app.runtime import Job, heap
from app.telemetry.timing import PhaseTimer

log = logging.getLogger("app.service")
# refusals that can leave part of the body unread: the connection closes after them (the
# server's protocol reads and drops the rest for a while first, app/http/timeouts.py)
BODY_LEFT_UNREAD = frozenset({408, 413})
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


# A declared body's room is claimed before it is read, and kept while the body keeps the pace
# that ends it within VAE_BODY_TIMEOUT_S; this long is free (a client's first bytes, a
# 100-continue). A body behind that pace (one that sends only its headers, or drips) loses
# what it has not sent: its room follows its bytes, and a client cannot hold the budget
# with requests it never sends.
CLAIM_GRACE_S = 2.0


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
        if more > 0 and not self.budget.take(self._fits(size, more)):
            raise self._full(size)
        self.held = max(self.held, size)

    def claim(self, size: int) -> None:
        """Claim a declared body's ``size`` bytes before they arrive (429, 413 as ``cover``)."""
        if not self.budget.take(self._fits(size, size), claim=True):
            raise self._full(size)
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

    def _fits(self, size: int, more: int) -> int:
        if size > self.budget.limit:
            raise ProtocolError(
                413,
                f"this request would hold {size} bytes, over the {self.budget.limit >> 20} MiB "
                "budget of what requests hold at once (VAE_BODIES_MB)",
            )
        return more

    def _full(self, size: int) -> ProtocolError:
        return ProtocolError(
            429,
            f"what requests hold fills the budget ({self.budget.limit >> 20} MiB, "
            f"VAE_BODIES_MB): this one's {size} bytes do not fit now",
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


async def handled(
    op: str,
    work: Callable[[PhaseTimer], Awaitable[Response]],
    request: Request,
    name: str | None,
    serving: Serving,
    output: str | None = None,
) -> Response:
    """One decode or encode request (``op``) answered and accounted for: counted in the
    drain while it runs, timed (``Server-Timing``), its metrics and log line once its whole
    body is out (a stream's when it closes). ``output``: the ``x-output`` label of answers
    that set none (an encode's, errors included)."""
    started = time.perf_counter()
    timer = PhaseTimer()
    request.state.logged = True  # its line comes from ``finisher``, with the phases
    serving.drain.active += 1
    try:
        response = await answered(op, request, lambda: work(timer), serving)
    except BaseException:  # cancelled by a hard shutdown: still account for it
        serving.drain.active -= 1
        raise
    if not isinstance(response, JobStream):  # it holds its answer now, until Envelope has
        hold(request, len(response.body), grow=False)  # sent it
    response.headers["Server-Timing"] = server_timing(timer.phases(), time.perf_counter() - started)
    if output is not None:
        response.headers.setdefault("x-output", output)
    finish = finisher(request, response, name, serving, timer, started, op)
    if isinstance(response, JobStream):
        response.on_close = _streaming(serving.drain, finish)
    else:
        finish(len(response.body))
    return response


def _streaming(drain: Drain, finish: Callable[[int], None]) -> Callable[[int], None]:
    """Count a stream in the drain's ``streams`` until it closes (then ``finish``)."""
    drain.streams += 1

    def closed(size: int) -> None:
        drain.streams -= 1
        finish(size)

    return closed


async def answered(
    op: str, request: Request, work: Callable[[], Awaitable[Response]], serving: Serving
) -> Response:
    """``work``'s response (a decode's or an encode's), or the JSON error that answers it."""
    settings, drain = serving.settings, serving.drain
    try:
        if drain.draining:
            raise ProtocolError(503, "the service is shutting down", ANOTHER_INSTANCE)
        return await work()
    except ProtocolError as exc:
        headers = {"Retry-After": str(settings.retry_after_s)} if exc.status in (429, 503) else {}
        unread = getattr(request.state, "body_unread", False)
        if drain.draining or unread or exc.status in BODY_LEFT_UNREAD:
            headers["Connection"] = "close"  # the server lingers: the client reads this
        return error_response(exc.status, exc.body(), headers)
    except ClientGone:
        return error_response(CLIENT_GONE, {"error": "the client disconnected"})
    except Exception:  # a server bug: answer JSON, keep the request's log line and metrics
        log.exception("%s request %s failed", op, request.state.request_id)
        return error_response(500, {"error": "internal server error"})


async def read_body(request: Request, limit: int, timeout_s: float) -> bytearray:
    """The body, within the process's body budget (its declared length claimed before it is
    read, 429 when the budget cannot hold it now; held as it arrives), refused with 413 as
    soon as it exceeds the limit (not after reading it all), with 408 when it does not arrive
    within ``timeout_s`` (a slow-loris upload), and with 503 at once when a shutdown begins
    while it is still arriving."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        request.state.body_unread = True
        raise body_too_large(request, f"a body of {declared[:32]} bytes", limit)
    lease = request.state.body_lease = BodyLease(request.app.state.bodies)
    size = None if declared is None else int(declared)
    reading = asyncio.ensure_future(_receive(request, lease, limit, size, timeout_s))
    shutdown = asyncio.ensure_future(request.app.state.drain.began.wait())
    try:
        done, _ = await asyncio.wait(
            {reading, shutdown}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if reading in done:
            return reading.result()  # the body, or the refusal raised while it arrived
    except ProtocolError:
        request.state.body_unread = True
        raise
    finally:
        reading.cancel()
        shutdown.cancel()
    request.state.body_unread = True
    if shutdown in done:
        raise ProtocolError(503, "the service is shutting down", ANOTHER_INSTANCE)
    raise ProtocolError(
        408,
        f"the body did not arrive within {timeout_s:g} s",
        "the whole body within VAE_BODY_TIMEOUT_S",
    )


def body_too_large(request: Request, body: str, limit: int) -> ProtocolError:
    """The 413 of a body over the body limit: the limit, the setting and the platform's
    request limit behind it, and what the client sends instead."""
    why = f"VAE_MAX_BODY_MB={limit >> 20}"
    if request.app.state.settings.platform == "cloud-run":
        why += f", below Cloud Run's {CLOUD_RUN_REQUEST_MB} MiB limit on HTTP/1 requests"
    if request.url.path.startswith("/encode"):
        instead = ("send the image as PNG, JPEG or WebP, or the video as an MP4, instead of a "
                   "raw pixel tensor; or fewer batch rows per request")  # fmt: skip
    else:
        instead = ("send the latent as bfloat16 or float16 (half of float32's bytes); or "
                   "fewer batch rows or frames per request")  # fmt: skip
    return ProtocolError(
        413,
        f"{body} exceeds the limit of {limit} bytes ({why})",
        f"a body of at most {limit} bytes: {instead}",
    )


def hold(request: Request, size: int, grow: bool = True) -> None:
    """What the request holds now, in the same budget as its body: once parsed, its input
    (the latent, the pixels, an MP4's temporary file) and the most its answer can be (429
    when that does not fit now: a small body can parse into large pixels, or ask for a large
    answer); once answered, its answer until it is sent (``grow=False``: never more than it
    reserved)."""
    lease = getattr(request.state, "body_lease", None)
    if lease is not None:
        lease.hold(size if grow else min(size, lease.held))


async def _receive(
    request: Request, lease: BodyLease, limit: int, size: int | None, timeout_s: float
) -> bytearray:
    try:
        if size is None:
            return await _receive_chunked(request, lease, limit)
        lease.claim(size)
        return await _receive_declared(request, lease, size, timeout_s)
    except ClientDisconnect:
        raise ClientGone from None


async def _receive_declared(
    request: Request, lease: BodyLease, size: int, timeout_s: float
) -> bytearray:
    """A body of a declared length, into one buffer that grows as it arrives (no chunks, no
    join): memory follows the bytes sent, not the length declared (a buffer of that length,
    zero-filled at once, made a request that sent only its headers cost its whole length).
    A large buffer grows in place (glibc remaps it). Its claim on the budget lapses once it
    falls behind the pace that would end it within ``timeout_s`` (``CLAIM_GRACE_S`` free)."""
    body = bytearray()
    started = time.monotonic()
    chunks = request.stream()
    while True:
        if lease.claimed:  # then size > 0
            pace = started + CLAIM_GRACE_S + len(body) * timeout_s / size
            chunk = await _on_pace(anext(chunks, b""), pace, lease)
        else:
            chunk = await anext(chunks, b"")  # b"": the end, as Starlette's
        if not chunk:
            break
        if len(body) + len(chunk) > size:  # h11 frames by Content-Length: never more
            raise ProtocolError(
                413,
                f"body exceeds its Content-Length of {size} bytes",
                "a body of its declared Content-Length",
            )
        lease.arrived(len(chunk))
        body += chunk
    if len(body) < size:  # a stream that ends early is a disconnect (Starlette raises it first)
        raise ClientGone
    return body


async def _on_pace(read: Awaitable[bytes], pace: float, lease: BodyLease) -> bytes:
    """``read``'s chunk; the lease's claim lapses if it has not come by ``pace``."""
    following = asyncio.ensure_future(read)
    try:
        done, _ = await asyncio.wait({following}, timeout=max(0.0, pace - time.monotonic()))
        if not done:
            lease.lapse()
        return await following
    finally:
        following.cancel()  # when this read itself is cancelled: a timeout, a drain
        # an exception the task holds has this frame in its traceback
        del following


async def _receive_chunked(request: Request, lease: BodyLease, limit: int) -> bytearray:
    """A chunked body: its budget share grows with it."""
    body = bytearray()
    async for chunk in request.stream():
        size = len(body) + len(chunk)
        if size > limit:
            raise body_too_large(request, f"a chunked body of {size} bytes so far", limit)
        lease.cover(size)
        body += chunk
    return body


def deadline(started: float, head: Head, settings: Settings) -> float:
    """perf_counter time by which the decode must start: the caller's timeout, capped."""
    seconds = min(head.timeout or settings.max_request_timeout_s, settings.max_request_timeout_s)
    return started + seconds


async def outcome(request: Request, job: Job, future: Future) -> Any:
    """The worker's answer for ``future``. A job still queued when its client disconnects or
    its deadline passes is dropped (no worker decodes it); one already started finishes.
    When a shutdown's drain grace runs out, the caller is answered 503 at once."""
    waiter = asyncio.wrap_future(future)
    gone = asyncio.ensure_future(_disconnected(request))
    expired = asyncio.ensure_future(request.app.state.drain.expired.wait())
    until = job.deadline
    try:
        while True:
            timeout = None if until is None else max(0.0, until - time.perf_counter())
            done, _ = await asyncio.wait(
                {waiter, gone, expired}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if waiter in done:
                return _result(waiter, job)
            if gone in done:
                _abandon(request, job)
                raise ClientGone
            if expired in done:
                _abandon(request, job)
                raise ProtocolError(
                    503,
                    f"the service is shutting down: its drain grace ran out before this "
                    f"{job.part.part} run finished",
                    ANOTHER_INSTANCE,
                )
            if job.future.cancel():  # still queued at its deadline: refuse it
                request.app.state.runtime.withdraw(job)
                raise deadline_error(time.perf_counter() - job.enqueued, job.part.part)
            until = None  # it started in time: let it finish
    except asyncio.CancelledError:
        _abandon(request, job)
        raise
    finally:
        gone.cancel()
        expired.cancel()
        waiter.cancel()  # no-op once done; else no "exception never retrieved" later


def _abandon(request: Request, job: Job) -> None:
    """Its caller left: the job stops, and leaves the queue at once if it waits there (its
    slot and its input are free now, not when the worker reaches it)."""
    job.abandon()
    request.app.state.runtime.withdraw(job)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone: with the body read, only a disconnect is left."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.01)


def _result(waiter: asyncio.Future, job: Job) -> Any:
    """A worker outcome -> the value, or the ProtocolError that answers it."""
    if waiter.cancelled():
        raise ProtocolError(503, "the decode was cancelled", "retry")
    exc = waiter.exception()
    if exc is None:
        return waiter.result()
    raise runtime_error(exc, job.part.name, job.part.part)
