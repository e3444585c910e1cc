"""``POST /decode``: head -> model -> validated request -> queue -> worker -> response.

The event loop never decodes: the handler builds a ``DecodeRequest`` (app.protocol), submits a
``Job`` and awaits its future, or the first frames of a streamed MP4. A preview
(``output_type=preview``) is answered without the queue (app/http/preview.py).
"""

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
from app.http.mp4 import JobStream, _mp4_response
from app.http.preview import format_of, preview_response
from app.http.responses import encoded, output_label
from app.http.serving import Serving
from app.protocol import Head, ProtocolError, parse_head, validate
from app.protocol.request import Output
from app.runtime import Job, ServedModel
from app.runtime.channel import FrameChannel
from app.runtime.scheduler import DeviceLost, QueueFull, Stopped
from app.store import NAME_RE
from app.telemetry.timing import PhaseTimer

log = logging.getLogger("app.service")
# refusals that can leave part of the body unread: the connection closes after them (the
# server's protocol reads and drops the rest for a while first, app/http/timeouts.py)
BODY_LEFT_UNREAD = frozenset({408, 413})


async def handle_decode(request: Request, name: str | None, serving: Serving) -> Response:
    work = lambda timer: _decode(request, name, serving, timer)  # noqa: E731
    return await handled("decode", work, request, name, serving)


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


async def _decode(
    request: Request, name: str | None, serving: Serving, timer: PhaseTimer
) -> Response:
    settings = serving.settings
    with timer.phase("parse"):
        head = parse_head(list(request.query_params.multi_items()), request.headers.items())
        model = resolve_model(name or head.params.model, serving)
        # refused before the body is read when the model's latents have no published factors
        preview_key = format_of(model) if head.params.output_type == "preview" else None

        async def read(limit: int) -> bytes:
            return await read_body(request, limit, settings.body_timeout_s)

        decode = await validate(
            head,
            model.geometry,
            model.limits(settings.limits()),
            read,
            deadline=deadline(request.state.started, head, settings),
            request_id=request.state.request_id,
            on_shape=lambda shape: setattr(request.state, "shape", shape),
        )
    if preview_key is not None:  # answered here: milliseconds, no queue, no decoder
        response = await preview_response(preview_key, decode, timer)
        response.headers["x-model"] = model.name
        response.headers["x-output"] = output_label(decode)
        return response
    streamed = decode.output is Output.MP4
    channel = FrameChannel(settings.stream_buffer_mb << 20, settings.stream_wait_s)
    job = Job(model, decode, timer, channel if streamed else None)
    try:
        serving.runtime.submit(job)
    except (QueueFull, Stopped, DeviceLost) as exc:
        raise runtime_error(exc, model.name) from None
    if streamed:
        await _outcome(request, job, channel.first)  # errors before the first frame: JSON
        return _mp4_response(job, decode.fps, model.name, settings.stream_stall_s)
    decoded = await _outcome(request, job, job.future)
    response = await asyncio.to_thread(encoded, decoded, decode, timer)
    response.headers["x-model"] = model.name
    response.headers["x-output"] = output_label(decode)
    return response


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


def resolve_model(name: str | None, serving: Serving) -> ServedModel:
    runtime = serving.runtime
    name = name or serving.settings.default_model
    if name is None and len(runtime.models) == 1:
        name = next(iter(runtime.models))
    if name is None:
        raise ProtocolError(
            400, "no model named", "POST /decode/{model}, ?model=, or set VAE_DEFAULT_MODEL"
        )
    if not NAME_RE.fullmatch(name):
        raise ProtocolError(404, "invalid model name", "letters, digits, '.', '_', '-'")
    if name in runtime.models:
        return runtime.models[name]
    if runtime.loading:
        raise ProtocolError(503, f"model {name!r} is still loading")
    if name in runtime.errors:
        raise ProtocolError(503, f"model {name!r} is not served: {runtime.errors[name]}")
    raise ProtocolError(404, f"model {name!r} not found", ", ".join(sorted(runtime.models)))


async def _outcome(request: Request, job: Job, future: Future) -> Any:
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
                    "the service is shutting down: its drain grace ran out before this decode "
                    "finished",
                    "retry: another instance",
                )
            if job.future.cancel():  # still queued at its deadline: refuse it
                raise deadline_error(time.perf_counter() - job.enqueued)
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
    raise runtime_error(exc, job.model.name)
