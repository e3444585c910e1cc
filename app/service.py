"""The HTTP service: FastAPI routes over the engine.

request -> parse + validate (protocol) -> bounded queue -> decode worker -> encode -> response
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import media
from app.config import Settings
from app.engine import Engine, Job, QueueFull, Scaling, ServedModel
from app.logging_json import log_request
from app.metrics import Metrics
from app.protocol import (
    IMAGE_MIME,
    DecodeParams,
    ProtocolError,
    check_limits,
    choose_output,
    parse_body,
    parse_params,
    to_layout,
)
from app.store import NAME_RE
from app.timing import PhaseTimer
from app.video import encode_mp4, iter_frames

log = logging.getLogger("app.service")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

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
        ]
    ],
}


def create_app(settings: Settings | None = None, *, load_in_background: bool = True) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    engine = Engine(settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.threads:
            torch.set_num_threads(settings.threads)
        engine.start()
        if load_in_background:
            threading.Thread(target=engine.load_all, name="model-loader", daemon=True).start()
        else:
            engine.load_all()
        yield
        engine.stop()

    app = FastAPI(
        title="VAE render service",
        version="0.1.0",
        summary="Latents in, pixels out: resident VAE decoders behind remote_decode's protocol.",
        lifespan=lifespan,
    )
    app.state.engine, app.state.metrics, app.state.settings = engine, metrics, settings
    _install_middleware(app)
    _install_error_handlers(app)
    _install_routes(app, engine, metrics, settings)
    return app


def _install_middleware(app: FastAPI) -> None:
    @app.middleware("http")
    async def request_id(request: Request, call_next: Any) -> Response:
        incoming = request.headers.get("x-request-id", "")
        rid = incoming if REQUEST_ID_RE.match(incoming) else uuid.uuid4().hex
        request.state.request_id = rid
        request.state.started = time.perf_counter()
        response = await call_next(request)
        response.headers["X-Request-Id"] = rid
        if "server-timing" not in response.headers:
            total = (time.perf_counter() - request.state.started) * 1000
            response.headers["Server-Timing"] = f"total;dur={total:.2f}"
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Cache-Control", "no-store")
        return response


def _error(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
        return _error(exc.status, exc.body())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, {"error": str(exc.detail)})

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, {"error": "invalid request", "detail": exc.errors()})


def _install_routes(app: FastAPI, engine: Engine, metrics: Metrics, settings: Settings) -> None:
    @app.get("/healthz", summary="Process alive")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="200 once every model is resident and gated")
    async def readyz() -> JSONResponse:
        body = {"ready": engine.ready, "models": sorted(engine.models), "errors": engine.errors}
        if engine.loading:
            body["reason"] = "loading models and running parity gates"
        elif not engine.ready:
            body["reason"] = "; ".join(f"{k}: {v}" for k, v in engine.errors.items()) or "no model"
        return JSONResponse(body, status_code=200 if engine.ready else 503)

    @app.get("/models", summary="Each model: family, config, device, dtype, parity, fallback")
    async def models() -> dict[str, Any]:
        return {
            "models": [m.describe() for m in engine.models.values()],
            "errors": engine.errors,
            "loading": engine.loading,
            "default": settings.default_model,
        }

    @app.get("/metrics", summary="Prometheus exposition")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.post(
        "/decode/{model}", summary="Decode one latent (batch allowed)", openapi_extra=BODY_DOC
    )
    async def decode_named(model: str, request: Request) -> Response:
        return await _handle_decode(request, model, engine, metrics, settings)

    @app.post("/decode", summary="Decode with ?model= or VAE_DEFAULT_MODEL", openapi_extra=BODY_DOC)
    async def decode_default(request: Request) -> Response:
        return await _handle_decode(request, None, engine, metrics, settings)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it exceeds the limit (not after reading it all)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ProtocolError(413, f"body of {declared} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ProtocolError(413, f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _resolve_model(
    name: str | None, params: DecodeParams, engine: Engine, settings: Settings
) -> ServedModel:
    name = name or params.model or settings.default_model
    if name is None and len(engine.models) == 1:
        name = next(iter(engine.models))
    if name is None:
        raise ProtocolError(
            400, "no model named", "POST /decode/{model}, ?model=, or set VAE_DEFAULT_MODEL"
        )
    if not NAME_RE.match(name):
        raise ProtocolError(404, "invalid model name", "letters, digits, '.', '_', '-'")
    if name in engine.models:
        return engine.models[name]
    if engine.loading:
        raise ProtocolError(503, f"model {name!r} is still loading")
    if name in engine.errors:
        raise ProtocolError(503, f"model {name!r} is not served: {engine.errors[name]}")
    raise ProtocolError(404, f"model {name!r} not found", ", ".join(sorted(engine.models)))


async def _handle_decode(
    request: Request, name: str | None, engine: Engine, metrics: Metrics, settings: Settings
) -> Response:
    started = time.perf_counter()
    timer = PhaseTimer()
    model_label, output_label, code = name or "-", "-", 500
    try:
        response = await _decode(request, name, engine, settings, timer)
        model_label = response.headers.get("x-model", model_label)
        output_label = response.headers.get("x-output", "-")
        code = response.status_code
    except ProtocolError as exc:
        code = exc.status
        headers = {"Retry-After": str(settings.retry_after_s)} if exc.status in (429, 503) else None
        response = _error(exc.status, exc.body(), headers)
    response.headers["Server-Timing"] = _server_timing(
        timer.phases(), time.perf_counter() - started
    )

    def finish(size: int) -> None:
        """Metrics and the request's log line, once the whole body has been produced."""
        elapsed, phases = time.perf_counter() - started, timer.phases()
        served = engine.models.get(model_label)
        if code < 400 and served is not None:
            metrics.observe_phases(model_label, served.serving_device, phases)
            metrics.request_seconds.labels(model_label, output_label).observe(elapsed)
            metrics.response_bytes.labels(model_label, output_label).observe(size)
        metrics.requests_total.labels(model_label if served else "-", output_label, str(code)).inc()
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

    if isinstance(response, StreamingResponse):
        response.body_iterator = _counted(response.body_iterator, finish)
    else:
        finish(len(response.body))
    return response


async def _decode(
    request: Request, name: str | None, engine: Engine, settings: Settings, timer: PhaseTimer
) -> Response:
    with timer.phase("parse"):
        params = parse_params(list(request.query_params.multi_items()))
        model = _resolve_model(name, params, engine, settings)
        body = await _read_body(request, settings.limits().max_body_bytes)
        geo = model.geometry
        kind, fmt = choose_output(params, request.headers.get("accept"), geo.is_video)
        latent = parse_body(request.headers.get("content-type"), body, params)
        request.state.shape = list(latent.shape)
        wire_dtype = latent.dtype
        latent = to_layout(latent, params, geo)
        check_limits(latent.float(), geo, settings.limits())
        if (
            kind == "image"
            and latent.shape[0] * (geo.frames_out(latent.shape[2]) if latent.ndim == 5 else 1) != 1
        ):
            raise ProtocolError(
                422,
                "an image response holds one image; this latent decodes to more",
                "batch 1 (one frame), or output_type=pt",
            )
    job = Job(model, latent.float(), _scaling(params), _options(params), timer)
    if kind == "mp4":
        if latent.shape[0] != 1:
            raise ProtocolError(
                422,
                f"an MP4 holds one video; this latent has a batch of {latent.shape[0]}",
                "batch 1, or output_type=pil|pt",
            )
        job.stream = queue.Queue(maxsize=2)
    try:
        future = engine.submit(job)
    except QueueFull:
        raise ProtocolError(
            429, "decode queue is full", "retry after Retry-After seconds"
        ) from None
    if kind == "mp4":
        fps = params.fps or model.reference.config.get("fps") or 24
        return _mp4_response(job, fps, model.name)
    try:
        decoded = await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        future.cancel()  # the client went away: drop the queued work
        raise
    except torch.OutOfMemoryError:
        raise ProtocolError(503, "out of memory decoding this latent", "a smaller latent") from None
    response = await asyncio.to_thread(
        _encode, model, decoded, kind, fmt, params, wire_dtype, timer
    )
    response.headers["x-model"] = model.name
    response.headers["x-output"] = kind if kind != "image" else fmt
    return response


async def _counted(body: AsyncIterator[bytes], done: Any) -> AsyncIterator[bytes]:
    """Pass a streamed body through, then report its size (also when the client left)."""
    size = 0
    try:
        async for chunk in body:
            size += len(chunk)
            yield chunk
    finally:
        done(size)


def _mp4_response(job: Job, fps: float, model: str) -> StreamingResponse:
    """Frames go into ffmpeg as the worker decodes them; MP4 bytes go out as ffmpeg writes."""

    def chunks() -> Iterator[torch.Tensor]:
        while True:
            item = job.stream.get()
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    def body() -> Iterator[bytes]:
        try:
            with job.timer.phase("encode"):
                yield from encode_mp4(iter_frames(chunks()), fps)
        finally:
            job.abandoned.set()

    headers = {"x-model": model, "x-output": "mp4"}
    return StreamingResponse(body(), media_type="video/mp4", headers=headers)


def _scaling(params: DecodeParams) -> Scaling:
    return Scaling(params.scaling_factor, params.shift_factor, params.do_scaling)


def _options(params: DecodeParams) -> dict[str, Any]:
    return {
        k: v for k, v in (("timestep", params.timestep), ("seed", params.seed)) if v is not None
    }


def _encode(
    model: ServedModel,
    decoded: torch.Tensor,
    kind: str,
    fmt: str,
    params: DecodeParams,
    wire_dtype: torch.dtype,
    timer: PhaseTimer,
) -> Response:
    """Decoder output -> response body, per the chosen output kind."""
    decoder = model.reference
    with timer.phase("encode"):
        if kind == "tensor":
            data, headers = media.tensor_bytes(decoded.to(wire_dtype))
            return Response(data, media_type="tensor/binary", headers=headers)
        frames = _frames(decoder.to_unit(decoded), decoded.ndim == 5)
        if kind == "uint8":
            data, headers = media.tensor_bytes(media.to_uint8_hwc(frames))
            return Response(data, media_type="tensor/binary", headers=headers)
        if kind == "unit_tensor":
            data, headers = media.tensor_bytes(frames.to(wire_dtype))
            return Response(data, media_type="tensor/binary", headers=headers)
        data = media.encode_image(frames[0], fmt, params.quality)
        return Response(data, media_type=IMAGE_MIME[fmt])


def _frames(unit: torch.Tensor, video: bool) -> torch.Tensor:
    """[B,3,H,W] stays; video [B,3,T,H,W] -> [B*T,3,H,W] frames in order."""
    if not video:
        return unit
    return unit.permute(0, 2, 1, 3, 4).reshape(-1, *unit.shape[1:2], *unit.shape[3:])


def _server_timing(phases: dict[str, float], total: float) -> str:
    parts = [f"{name};dur={seconds * 1000:.2f}" for name, seconds in phases.items()]
    parts.append(f"total;dur={total * 1000:.2f}")
    return ", ".join(parts)
