"""What every decode and encode request goes through, whatever its body: accounting (the
drain, ``Server-Timing``, metrics and the log line), the JSON answer of a refusal, the answer
held in the budget until it is sent, the deadline, and the wait for the worker's outcome (a
client that leaves, a deadline that passes, a drain that runs out). The body itself:
app/http/body.py."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

from fastapi import Request, Response

from app.config import Settings
from app.http.accounting import finisher, server_timing
from app.http.body import hold
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
from app.runtime import Job
from app.telemetry.timing import PhaseTimer

log = logging.getLogger("app.service")
# refusals that can leave part of the body unread: the connection closes after them (the
# server's protocol reads and drops the rest for a while first, app/http/timeouts.py)
BODY_LEFT_UNREAD = frozenset({408, 413})


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
