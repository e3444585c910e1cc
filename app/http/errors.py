"""Every error the HTTP layer answers, as JSON: the framework's own (404, 405, 422 from
FastAPI), the protocol's refusals, and the one mapping from runtime outcomes to answers."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from app.protocol import ProtocolError, echo
from app.runtime.device import is_oom
from app.runtime.runner import InvalidInput, NonFiniteOutput, OutOfMemory, TooLarge
from app.runtime.scheduler import DeadlineExceeded, DeviceLost, QueueFull, Stopped, StreamsFull

CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never sent
ANOTHER_INSTANCE = "retry: another instance"


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def error_response(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def runtime_error(exc: BaseException, model: str, part: str = "decoder") -> ProtocolError:
    """What a client is told when the runtime refuses or fails its run (at submit or from the
    worker): one wording per cause; ``part`` names the decoder or the encoder that ran."""
    if isinstance(exc, StreamsFull):  # a QueueFull: checked first
        return ProtocolError(
            429, f"the streamed answers' cap is reached: {exc}", "retry after Retry-After seconds"
        )
    if isinstance(exc, QueueFull):
        return ProtocolError(429, "the queue is full", "retry after Retry-After seconds")
    if isinstance(exc, DeadlineExceeded):
        return deadline_error(exc.waited, part)
    if isinstance(exc, Stopped):
        return ProtocolError(503, "the service is shutting down", ANOTHER_INSTANCE)
    if isinstance(exc, DeviceLost):
        return ProtocolError(503, f"this instance lost its device: {exc}", ANOTHER_INSTANCE)
    if isinstance(exc, InvalidInput):
        return ProtocolError(
            422,
            f"the encoder refused the input: {exc}"[:300],
            "an input this model's encoder takes (GET /models: its family and config)",
        )
    if isinstance(exc, NonFiniteOutput):
        expected = "pixels in [-1, 1]" if part == "encoder" else "a latent in the decoder's range"
        return ProtocolError(422, str(exc), f"{expected}, and finite factors")
    if isinstance(exc, TooLarge):
        return ProtocolError(413, f"too large for this instance: {exc}"[:300], "a smaller latent")
    if isinstance(exc, OutOfMemory) or is_oom(exc):
        return ProtocolError(503, f"out of memory: {exc}"[:300], "a smaller latent, or retry")
    return ProtocolError(  # a server fault, not bad input: 503, and the worker goes on
        503,
        f"{part} of model {model!r} failed: {type(exc).__name__}: {str(exc)[:200]}",
        "retry later; the request id is in X-Request-Id",
    )


def deadline_error(waited: float, part: str = "decoder") -> ProtocolError:
    run = "encode" if part == "encoder" else "decode"
    return ProtocolError(
        503,
        f"deadline exceeded: the {run} could not start within the request's timeout "
        f"(queued {waited:.2f} s)",
        "a longer X-Request-Timeout, or retry after Retry-After seconds",
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
        return error_response(exc.status, exc.body())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404 and (location := _without_trailing_slash(app, request.scope)):
            return Response(status_code=307, headers={"Location": location})
        body = {"error": str(exc.detail)}
        if exc.status_code == 404:  # no such route (a model name with a "/" lands here too)
            body["expected"] = (
                "a route of GET /openapi.json; model names: letters, digits, '.', '_', '-'"
            )
        elif exc.status_code == 405:
            body["expected"] = "a method the route takes (GET /openapi.json)"
        return error_response(exc.status_code, body, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        detail = [{**e, "input": echo(e.get("input"))} if "input" in e else e for e in exc.errors()]
        return error_response(422, {"error": "invalid request", "detail": detail[:8]})


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
