"""What every decode and encode request goes through, whatever its body: accounting (the
drain, ``Server-Timing``, metrics and the log line), the JSON answer of a refusal, the body read
within its limit and time, the deadline, and the wait for the worker's outcome (a client that
leaves, a deadline that passes, a drain that runs out)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

from fastapi import Request, Response
from starlette.requests import ClientDisconnect

from app.config import Settings
from app.http.accounting import finisher, server_timing
from app.http.errors import CLIENT_GONE, ClientGone, deadline_error, error_response, runtime_error
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
    response.headers["Server-Timing"] = server_timing(timer.phases(), time.perf_counter() - started)
    if output is not None:
        response.headers.setdefault("x-output", output)
    finish = finisher(request, response, name, serving, timer, started, op)
    if isinstance(response, JobStream):
        response.on_close = finish
    else:
        finish(len(response.body))
    return response


async def answered(
    op: str, request: Request, work: Callable[[], Awaitable[Response]], serving: Serving
) -> Response:
    """``work``'s response (a decode's or an encode's), or the JSON error that answers it."""
    settings, drain = serving.settings, serving.drain
    try:
        if drain.draining:
            raise ProtocolError(503, "the service is shutting down", "retry: another instance")
        return await work()
    except ProtocolError as exc:
        headers = {"Retry-After": str(settings.retry_after_s)} if exc.status in (429, 503) else {}
        if drain.draining or exc.status in BODY_LEFT_UNREAD:
            headers["Connection"] = "close"  # the server lingers: the client reads this
        return error_response(exc.status, exc.body(), headers)
    except ClientGone:
        return error_response(CLIENT_GONE, {"error": "the client disconnected"})
    except Exception:  # a server bug: answer JSON, keep the request's log line and metrics
        log.exception("%s request %s failed", op, request.state.request_id)
        return error_response(500, {"error": "internal server error"})


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refused with 413 as soon as it exceeds the limit (not after reading it all),
    and with 408 when it does not arrive within ``timeout_s`` (a slow-loris upload)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ProtocolError(413, f"body of {declared[:32]} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ProtocolError(413, f"body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise ProtocolError(408, f"the body did not arrive within {timeout_s:g} s") from None
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


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
                job.abandon()
                raise ClientGone
            if expired in done:
                job.abandon()
                raise ProtocolError(
                    503,
                    f"the service is shutting down: its drain grace ran out before this "
                    f"{job.part.part} run finished",
                    "retry: another instance",
                )
            if job.future.cancel():  # still queued at its deadline: refuse it
                raise deadline_error(time.perf_counter() - job.enqueued, job.part.part)
            until = None  # it started in time: let it finish
    except asyncio.CancelledError:
        job.abandon()
        raise
    finally:
        gone.cancel()
        expired.cancel()
        waiter.cancel()  # no-op once done; else no "exception never retrieved" later


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
