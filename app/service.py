"""The HTTP service: FastAPI routes over the runtime.

request -> parse + validate (protocol) -> bounded queue -> decode worker -> encode -> response
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import media
from app.auth import BearerAuth
from app.config import Settings
from app.drain import Drain, route_sigterm
from app.logging_json import log_request
from app.metrics import Metrics, code_class
from app.protocol import (
    IMAGE_MIME,
    DecodeParams,
    Limits,
    ProtocolError,
    check_content_encoding,
    check_declared,
    check_limits,
    check_scaling,
    choose_output,
    echo,
    parse_body,
    parse_params,
    parse_timeout,
    to_layout,
)
from app.runtime import Job, Runtime, Scaling, ServedModel, Want
from app.runtime.channel import FrameChannel
from app.runtime.device import is_oom
from app.runtime.runner import NonFiniteOutput, OutOfMemory
from app.runtime.scheduler import DeadlineExceeded, DeviceLost, QueueFull, Stopped
from app.store import NAME_RE
from app.timing import PhaseTimer
from app.video import encode_mp4

log = logging.getLogger("app.service")
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")  # fullmatch: "$" lets a "\n" through
CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never sent
# Safe by default for an API that browsers should never render or frame (OWASP REST sheet).
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
API_CSP = "default-src 'none'; frame-ancestors 'none'"
DOC_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc"})  # Swagger UI needs scripts

BODY_DOC = {
    "requestBody": {
        "required": True,
        "description": "The latent: raw little-endian tensor bytes (with `shape` and `dtype` "
        "params), a safetensors file holding one tensor, or a `.npy` file.",
        "content": {
            "tensor/binary": {"schema": {"type": "string", "format": "binary"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "application/x-safetensors": {"schema": {"type": "string", "format": "binary"}},
            "application/x-npy": {"schema": {"type": "string", "format": "binary"}},
        },
    },
    "parameters": [
        {"name": n, "in": "query", "required": False, "schema": s, "description": d}
        for n, s, d in [
            (
                "shape",
                {"type": "array", "items": {"type": "integer"}},
                "latent shape for raw bodies; repeated keys or a JSON list",
            ),
            ("dtype", {"type": "string", "enum": ["float32", "float16", "bfloat16"]}, "raw dtype"),
            ("output_type", {"type": "string", "enum": ["pil", "pt", "mp4"]}, "what to return"),
            ("image_format", {"type": "string", "enum": ["png", "jpg", "webp"]}, "image format"),
            ("partial_postprocess", {"type": "boolean"}, "pt: uint8 [B,H,W,3] instead"),
            ("scaling_factor", {"type": "number"}, "latent / scaling_factor"),
            ("shift_factor", {"type": "number"}, "latent + shift_factor"),
            ("do_scaling", {"type": "boolean"}, "apply the model's own de-normalization"),
            ("height", {"type": "integer"}, "pixel height for packed latents"),
            ("width", {"type": "integer"}, "pixel width for packed latents"),
            ("fps", {"type": "number"}, "mp4 frame rate"),
            ("timestep", {"type": "number"}, "decode timestep (timestep-conditioned LTX)"),
            ("seed", {"type": "integer"}, "noise seed (LTX noise injection)"),
            ("quality", {"type": "integer"}, "jpg/webp quality 1..100"),
            ("timeout", {"type": "number"}, "seconds this request may wait to start (capped)"),
        ]
    ]
    + [
        {
            "name": "X-Request-Timeout",
            "in": "header",
            "required": False,
            "schema": {"type": "number"},
            "description": "seconds this request may wait to start; capped by the server",
        }
    ],
}


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def create_app(settings: Settings | None = None, *, load_in_background: bool = True) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    runtime = Runtime(settings, metrics)
    drain = Drain(settings.drain_grace_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.threads:
            torch.set_num_threads(settings.threads)
        runtime.start()
        restore = route_sigterm(drain)
        if threading.current_thread() is threading.main_thread():
            # a sticky device error: drain (queued requests get 503) and exit, so the
            # platform replaces this instance
            runtime.on_device_lost = lambda reason: os.kill(os.getpid(), signal.SIGTERM)
        if load_in_background:
            threading.Thread(target=runtime.load_all, name="model-loader", daemon=True).start()
        else:
            runtime.load_all()
        yield
        restore()
        # After a drain that ran out, the worker may still be decoding work already answered
        # 503: do not hold the exit for it.
        runtime.stop(timeout=0.5 if drain.expired.is_set() else 10.0)

    app = FastAPI(
        title="VAE render service",
        version="0.1.0",
        summary="Latents in, pixels out: resident VAE decoders behind remote_decode's protocol.",
        lifespan=lifespan,
    )
    app.state.runtime, app.state.metrics, app.state.settings = runtime, metrics, settings
    app.state.drain = drain
    app.router.redirect_slashes = False  # Starlette's builds Location from Host: see http_error
    # the last added is the outermost: the envelope also wraps auth's 401s
    app.add_middleware(
        BearerAuth, tokens=settings.tokens(), protect_metrics=settings.protect_metrics
    )
    app.add_middleware(Envelope)
    _install_error_handlers(app)
    _install_routes(app, runtime, metrics, settings, drain)
    return app


class Envelope:
    """Outermost middleware: request id, a Server-Timing fallback, safe headers on every
    response, and a JSON 500 (logged with the request id) for anything unhandled."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        incoming = _header(scope, b"x-request-id")
        rid = incoming if REQUEST_ID_RE.fullmatch(incoming) else uuid.uuid4().hex
        started = time.perf_counter()
        state = scope.setdefault("state", {})
        state["request_id"], state["started"] = rid, started
        sent = False

        async def send_with_headers(message: Message) -> None:
            nonlocal sent
            if message["type"] == "http.response.start":
                sent = True
                _decorate(MutableHeaders(scope=message), rid, started, scope["path"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception:
            log.exception("unhandled error in request %s", rid)
            if sent:
                raise
            body = {"error": "internal server error", "request_id": rid}
            await _error(500, body)(scope, receive, send_with_headers)


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return ""


def _decorate(headers: MutableHeaders, rid: str, started: float, path: str) -> None:
    headers["X-Request-Id"] = rid
    if "server-timing" not in headers:
        headers["Server-Timing"] = f"total;dur={(time.perf_counter() - started) * 1000:.2f}"
    for name, value in SECURITY_HEADERS.items():
        headers.setdefault(name, value)
    if path not in DOC_PATHS:
        headers.setdefault("Content-Security-Policy", API_CSP)


def _error(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
        return _error(exc.status, exc.body())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404 and (location := _without_trailing_slash(app, request.scope)):
            return Response(status_code=307, headers={"Location": location})
        return _error(exc.status_code, {"error": str(exc.detail)}, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        detail = [{**e, "input": echo(e.get("input"))} if "input" in e else e for e in exc.errors()]
        return _error(422, {"error": "invalid request", "detail": detail[:8]})


def _without_trailing_slash(app: FastAPI, scope: Scope) -> str | None:
    """``/healthz/`` -> ``/healthz`` when that is a route: a path-only ``Location`` (never
    built from the Host header, never ``//host`` that a browser would read as a host)."""
    path = scope["path"]
    stripped = path.rstrip("/")
    if path == stripped or not stripped.startswith("/") or stripped.startswith("//"):
        return None
    target = {**scope, "path": stripped}
    if not any(route.matches(target)[0] != Match.NONE for route in app.router.routes):
        return None
    query = scope.get("query_string", b"").decode("latin-1")
    return quote(stripped) + (f"?{query}" if query else "")


def _install_routes(
    app: FastAPI, runtime: Runtime, metrics: Metrics, settings: Settings, drain: Drain
) -> None:
    @app.get("/healthz", summary="Process alive")
    @app.head("/healthz", include_in_schema=False)  # load balancers probe with HEAD too
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="200 once every model is resident and gated")
    @app.head("/readyz", include_in_schema=False)
    async def readyz() -> JSONResponse:
        ready = runtime.ready and not drain.draining
        body = {"ready": ready, "models": sorted(runtime.models), "errors": runtime.errors}
        body["states"] = runtime.registry.describe_states()  # loading/gating/ready/failed
        if drain.draining:
            body["reason"] = "draining: the service is shutting down"
        elif runtime.loading:
            body["reason"] = "loading models and running parity gates"
        elif runtime.device_lost:
            body["reason"] = f"device lost: {runtime.device_lost}"
        elif runtime.worker_died:
            body["reason"] = "the decode worker has stopped"
        elif runtime.errors:
            body["reason"] = "; ".join(f"{k}: {v}" for k, v in runtime.errors.items())
        elif not ready:
            body["reason"] = "no model"
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/models", summary="Each model: family, config, device, dtype, parity, fallback")
    async def models() -> dict[str, Any]:
        return {
            "models": [m.describe() for m in runtime.models.values()],
            "errors": runtime.errors,
            "loading": runtime.loading,
            "states": runtime.registry.describe_states(),
            "default": settings.default_model,
        }

    @app.get("/metrics", summary="Prometheus exposition")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.post(
        "/decode/{model}", summary="Decode one latent (batch allowed)", openapi_extra=BODY_DOC
    )
    async def decode_named(model: str, request: Request) -> Response:
        return await _handle_decode(request, model, runtime, metrics, settings, drain)

    @app.post("/decode", summary="Decode with ?model= or VAE_DEFAULT_MODEL", openapi_extra=BODY_DOC)
    async def decode_default(request: Request) -> Response:
        return await _handle_decode(request, None, runtime, metrics, settings, drain)


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
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


def _deadline(request: Request, params: DecodeParams, settings: Settings) -> float:
    """perf_counter time by which the decode must start: the caller's timeout, capped."""
    header = request.headers.get("x-request-timeout")
    asked = parse_timeout("X-Request-Timeout", header) if header is not None else params.timeout
    seconds = min(asked or settings.max_request_timeout_s, settings.max_request_timeout_s)
    return request.state.started + seconds


def _resolve_model(
    name: str | None, params: DecodeParams, runtime: Runtime, settings: Settings
) -> ServedModel:
    name = name or params.model or settings.default_model
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


async def _handle_decode(
    request: Request,
    name: str | None,
    runtime: Runtime,
    metrics: Metrics,
    settings: Settings,
    drain: Drain,
) -> Response:
    started = time.perf_counter()
    timer = PhaseTimer()
    drain.active += 1
    try:
        response = await _answer(request, name, runtime, settings, drain, timer)
    except BaseException:  # cancelled by a hard shutdown: still account for it
        drain.active -= 1
        raise
    response.headers["Server-Timing"] = _server_timing(
        timer.phases(), time.perf_counter() - started
    )
    finish = _finisher(request, response, name, runtime, metrics, drain, timer, started)
    if isinstance(response, JobStream):
        response.on_close = finish
    else:
        finish(len(response.body))
    return response


async def _answer(
    request: Request,
    name: str | None,
    runtime: Runtime,
    settings: Settings,
    drain: Drain,
    timer: PhaseTimer,
) -> Response:
    """The decode's response, or the JSON error that answers it instead."""
    try:
        if drain.draining:
            raise ProtocolError(503, "the service is shutting down", "retry: another instance")
        return await _decode(request, name, runtime, settings, timer)
    except ProtocolError as exc:
        headers = {"Retry-After": str(settings.retry_after_s)} if exc.status in (429, 503) else {}
        if drain.draining:
            headers["Connection"] = "close"
        return _error(exc.status, exc.body(), headers)
    except ClientGone:
        return _error(CLIENT_GONE, {"error": "the client disconnected"})
    except Exception:  # a server bug: answer JSON, keep the request's log line and metrics
        log.exception("decode request %s failed", request.state.request_id)
        return _error(500, {"error": "internal server error"})


def _finisher(
    request: Request,
    response: Response,
    name: str | None,
    runtime: Runtime,
    metrics: Metrics,
    drain: Drain,
    timer: PhaseTimer,
    started: float,
) -> Callable[[int], None]:
    """Metrics and the request's log line, once the whole body has been produced (once)."""
    code = response.status_code
    model_label = response.headers.get("x-model", name or "-")
    output_label = response.headers.get("x-output", "-")
    done = False

    def finish(size: int) -> None:
        nonlocal done
        if done:
            return
        done = True
        drain.active -= 1
        elapsed, phases = time.perf_counter() - started, timer.phases()
        served = runtime.models.get(model_label)
        model_seen = model_label if served else "-"
        if code < 400 and served is not None:
            metrics.observe_phases(model_label, served.serving_device, phases)
            metrics.response_bytes.labels(model_label, output_label).observe(size)
        # every outcome, so timeouts and 503s show in the latency too
        metrics.request_seconds.labels(model_seen, output_label, code_class(code)).observe(elapsed)
        metrics.requests_total.labels(model_seen, output_label, str(code)).inc()
        log_request(
            request.state.request_id,
            model_label,
            getattr(request.state, "shape", None),
            output_label,
            code,
            {k: v * 1000 for k, v in phases.items()},
            served.serving_device if served else None,
            served.fallback if served else None,
            elapsed,
            request.method,
            str(request.url),
            request.headers.get("user-agent"),
            size,
            trace_header=request.headers.get("x-cloud-trace-context")
            or request.headers.get("traceparent"),
            remote_ip=request.client.host if request.client else None,
        )

    return finish


async def _decode(
    request: Request, name: str | None, runtime: Runtime, settings: Settings, timer: PhaseTimer
) -> Response:
    with timer.phase("parse"):
        params = parse_params(list(request.query_params.multi_items()))
        deadline = _deadline(request, params, settings)
        model = _resolve_model(name, params, runtime, settings)
        limits = model.limits(settings.limits())
        content_type = request.headers.get("content-type")
        check_content_encoding(request.headers.get("content-encoding"))
        geo = model.geometry
        kind, fmt = choose_output(params, request.headers.get("accept"), geo.is_video)
        check_declared(params, content_type, geo, limits, kind)  # before reading the body
        body = await _read_body(request, limits.max_body_bytes, settings.body_timeout_s)
        latent = _validated(body, content_type, params, model, limits, kind, request)
    job = Job(model, latent.float(), _scaling(params), _options(params), timer, WANT[kind])
    job.out_dtype = torch.uint8 if kind in ("image", "uint8", "mp4") else latent.dtype
    job.deadline = deadline
    if kind == "mp4":
        job.channel = FrameChannel(settings.stream_buffer_mb << 20, settings.stream_wait_s)
    try:
        runtime.submit(job)
    except QueueFull:
        raise ProtocolError(
            429, "decode queue is full", "retry after Retry-After seconds"
        ) from None
    except Stopped:
        raise ProtocolError(
            503, "the service is shutting down", "retry: another instance"
        ) from None
    except DeviceLost as exc:
        raise ProtocolError(
            503, f"this instance lost its device: {exc}", "another instance"
        ) from None
    if kind == "mp4":
        # errors before the first frame are still JSON
        await _outcome(request, job, job.channel.first)
        fps = params.fps or model.reference.config.get("fps") or 24
        return _mp4_response(job, fps, model.name, settings.stream_stall_s)
    decoded = await _outcome(request, job, job.future)
    response = await asyncio.to_thread(_encode, decoded, kind, fmt, params, timer)
    response.headers["x-model"] = model.name
    response.headers["x-output"] = kind if kind != "image" else fmt
    return response


def _validated(
    body: bytes,
    content_type: str | None,
    params: DecodeParams,
    model: ServedModel,
    limits: Limits,
    kind: str,
    request: Request,
) -> torch.Tensor:
    """The body as a latent in the model's layout, within its limits, for this output kind."""
    geo = model.geometry
    latent = parse_body(content_type, body, params)
    request.state.shape = list(latent.shape)
    latent = to_layout(latent, params, geo)
    check_limits(latent, geo, limits, kind)
    check_scaling(latent, params)
    images = latent.shape[0] * (geo.frames_out(latent.shape[2]) if latent.ndim == 5 else 1)
    if kind == "image" and images != 1:
        raise ProtocolError(
            422,
            "an image response holds one image; this latent decodes to more",
            "batch 1 (one frame), or output_type=pt",
        )
    if kind == "mp4" and latent.shape[0] != 1:
        raise ProtocolError(
            422,
            f"an MP4 holds one video; this latent has a batch of {latent.shape[0]}",
            "batch 1, or output_type=pil|pt",
        )
    return latent


async def _outcome(request: Request, job: Job, future: Future) -> Any:
    """The worker's answer for ``future``. A job still queued when its client disconnects or
    its deadline passes is dropped (no worker decodes it); one already started finishes.
    When a shutdown's drain grace runs out, the caller is answered 503 at once."""
    waiter = asyncio.wrap_future(future)
    gone = asyncio.ensure_future(_disconnected(request))
    expired = asyncio.ensure_future(request.app.state.drain.expired.wait())
    deadline = job.deadline
    try:
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
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
                raise _deadline_error(time.perf_counter() - job.enqueued)
            deadline = None  # it started in time: let it finish
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
    if isinstance(exc, DeadlineExceeded):
        raise _deadline_error(exc.waited)
    if isinstance(exc, Stopped):
        raise ProtocolError(503, "the service is shutting down", "retry: another instance")
    if isinstance(exc, DeviceLost):
        raise ProtocolError(503, f"this instance lost its device: {exc}", "retry: another instance")
    if isinstance(exc, NonFiniteOutput):
        raise ProtocolError(422, str(exc), "a latent and factors in the decoder's range")
    if isinstance(exc, OutOfMemory) or is_oom(exc):
        raise ProtocolError(503, f"out of memory: {exc}"[:300], "a smaller latent, or retry")
    raise ProtocolError(  # a server fault, not bad input: 503, and the worker goes on
        503,
        f"decoder of model {job.model.name!r} failed: {type(exc).__name__}: {str(exc)[:200]}",
        "retry later; the request id is in X-Request-Id",
    )


def _deadline_error(waited: float) -> ProtocolError:
    return ProtocolError(
        503,
        f"deadline exceeded: the decode could not start within the request's timeout "
        f"(queued {waited:.2f} s)",
        "a longer X-Request-Timeout, or retry after Retry-After seconds",
    )


class JobStream(StreamingResponse):
    """A streamed job's response. However it ends (done, client gone, error) the worker is
    told to stop, and ``on_close`` gets the bytes sent. A client that reads nothing for
    ``stall_s`` is dropped, and so is a stream the worker gave up: the response is then
    aborted (no terminating chunk), so the client sees the truncation."""

    def __init__(self, job: Job, content: Iterator[bytes], stall_s: float, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.job, self.sent, self.stall_s = job, 0, stall_s
        self.on_close: Callable[[int], None] | None = None
        self.body_iterator = self._counted(self.body_iterator)

    async def _counted(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in body:
            self.sent += len(chunk)
            yield chunk

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watched() -> Message:
            # Stop the worker at once: the cancellation that follows a disconnect only lands
            # once the encoder thread returns, which can be a whole MP4 fragment later.
            message = await receive()
            if message["type"] == "http.disconnect":
                self.job.abandon()
            return message

        async def send_or_drop(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.stall_s)
            except TimeoutError:
                self.job.abandon()
                raise StreamAborted(f"the client read nothing for {self.stall_s:g} s") from None

        try:
            await super().__call__(scope, watched, send_or_drop)
        finally:
            self.job.abandon()
            if self.on_close is not None:
                self.on_close(self.sent)


class StreamAborted(Exception):
    """A streamed response given up midway: raised through the server, which then closes the
    connection without ending the body, so the client sees the truncation."""


def _mp4_response(job: Job, fps: float, model: str, stall_s: float) -> JobStream:
    """Frames go into ffmpeg as the worker decodes them; MP4 bytes go out as ffmpeg writes."""

    # "encode" is ffmpeg's share alone: the waits for decoded frames (the decoder's own
    # phases) and for the client to read (suspended at yield) are taken out.
    elsewhere = 0.0

    def frames() -> Iterator[Any]:
        nonlocal elsewhere
        chunks = iter(job.channel)
        while True:
            t0 = time.perf_counter()
            try:
                chunk = next(chunks, None)
            finally:
                elsewhere += time.perf_counter() - t0
            if chunk is None:
                return
            yield from chunk.numpy()

    def body() -> Iterator[bytes]:
        nonlocal elsewhere
        started = time.perf_counter()
        try:
            for data in encode_mp4(frames(), fps):
                t0 = time.perf_counter()
                yield data
                elsewhere += time.perf_counter() - t0
        except Exception as exc:  # the decode failed or the stream was dropped midway
            log.warning("MP4 stream of model %s aborted: %s", model, exc)
            raise StreamAborted(str(exc)) from exc
        finally:
            job.timer.add("encode", max(0.0, time.perf_counter() - started - elsewhere))
            job.abandoned.set()

    headers = {"x-model": model, "x-output": "mp4"}
    return JobStream(job, body(), stall_s, media_type="video/mp4", headers=headers)


def _scaling(params: DecodeParams) -> Scaling:
    return Scaling(params.scaling_factor, params.shift_factor, params.do_scaling)


def _options(params: DecodeParams) -> dict[str, Any]:
    return {
        k: v for k, v in (("timestep", params.timestep), ("seed", params.seed)) if v is not None
    }


# what the runner hands back for each output kind
WANT = {
    "tensor": Want.RAW,
    "unit_tensor": Want.UNIT,
    "uint8": Want.UINT8,
    "image": Want.UINT8,
    "mp4": Want.UINT8,
}


def _encode(
    decoded: torch.Tensor, kind: str, fmt: str, params: DecodeParams, timer: PhaseTimer
) -> Response:
    """The runner's host tensor -> response body, per the chosen output kind (the runner
    has already refused a non-finite decode)."""
    with timer.phase("encode"):
        if kind == "image":
            data = media.encode_image(decoded[0], fmt, params.quality)
            return Response(data, media_type=IMAGE_MIME[fmt])
        data, headers = media.tensor_bytes(decoded)
        return Response(data, media_type="tensor/binary", headers=headers)


def _server_timing(phases: dict[str, float], total: float) -> str:
    parts = [f"{name};dur={seconds * 1000:.2f}" for name, seconds in phases.items()]
    parts.append(f"total;dur={total * 1000:.2f}")
    return ", ".join(parts)
