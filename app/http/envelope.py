"""The outermost middleware: request id, safe headers, a JSON 500 for anything unhandled."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http.errors import error_response
from app.http.streams import ReaderProgress, StreamAborted, send_body
from app.telemetry.logs import log_request

log = logging.getLogger("app.service")
# a caller's id is kept when it is 1-128 visible ASCII characters but the quote and the
# backslash (UUIDs in braces, "job:42/step-3", base64, W3C trace ids): nothing a log line or a
# header could be split or escaped by; fullmatch: "$" lets a "\n" through
REQUEST_ID_RE = re.compile(r"[!#-\[\]-~]{1,128}")
# Safe by default for an API that browsers should never render or frame (OWASP REST sheet).
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
# a default: the pages for people (``/``, ``/docs``) send their own (page.py, docs.py)
API_CSP = "default-src 'none'; frame-ancestors 'none'"
# probes, scrapes, and what the page (``/``) polls and loads: DEBUG when answered as expected
QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/models", "/"})


class Envelope:
    """Outermost middleware: request id, a Server-Timing fallback, safe headers on every
    response, and a JSON 500 (logged with the request id) for anything unhandled."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        incoming = header(scope, b"x-request-id")
        rid = incoming if REQUEST_ID_RE.fullmatch(incoming) else uuid.uuid4().hex
        started = time.perf_counter()
        state = scope.setdefault("state", {})
        state["request_id"], state["started"] = rid, started
        sent, status, size = False, 500, 0
        # every answer's body: a reader that takes nothing for the stall limit is dropped, so
        # it cannot hold its answer, and the body budget that answer holds, for ever
        stall_s = _stall_s(scope)
        reader = ReaderProgress(scope)  # a stream's own (its send buffer set) in the state

        async def send_with_headers(message: Message) -> None:
            nonlocal sent, status, size
            if message["type"] == "http.response.start":
                sent, status = True, message["status"]
                _decorate(MutableHeaders(scope=message), rid, started)
            elif message["type"] == "http.response.body":
                size += len(message.get("body", b""))
                if stall_s:
                    return await send_body(send, message, state.get("reader", reader), stall_s)
            await send(message)

        try:
            await self._answer(scope, receive, send_with_headers, rid, lambda: sent)
        finally:
            reader.close()
            lease = state.get("body_lease")  # what the request held: its answer is out now
            if lease is not None:
                lease.release()
            if not state.get("logged"):  # the decode and encode handlers log their own line
                _log(scope, rid, status, size, time.perf_counter() - started)

    async def _answer(
        self, scope: Scope, receive: Receive, send_with_headers: Send, rid: str, sent: Callable
    ) -> None:
        if header(scope, b"content-length") and header(scope, b"transfer-encoding"):
            # framed twice (RFC 9112 6.3): a proxy that frames by Content-Length would read
            # the rest as another request; refuse it and close, so nothing after it runs
            return await error_response(
                400,
                {
                    "error": "both Content-Length and Transfer-Encoding: the request is framed "
                    "twice",
                    "expected": "one of them (RFC 9112 section 6.3)",
                },
                {"Connection": "close"},
            )(scope, receive, send_with_headers)
        try:
            await self.app(scope, receive, send_with_headers)
        except StreamAborted as exc:
            if not exc.logged:  # a stream logs its own, with its kind and model
                log.warning("answer aborted: request %s: %s", rid, exc)
            raise  # the server closes the connection: the client sees the truncation
        except Exception:
            log.exception("unhandled error in request %s", rid)
            if sent():
                raise
            body = {"error": "internal server error", "request_id": rid}
            await error_response(500, body)(scope, receive, send_with_headers)


def _stall_s(scope: Scope) -> float | None:
    """``VAE_STREAM_STALL_S`` of the app served (None outside one: no limit)."""
    settings = getattr(getattr(scope.get("app"), "state", None), "settings", None)
    return getattr(settings, "stream_stall_s", None)


def _log(scope: Scope, rid: str, status: int, size: int, seconds: float) -> None:
    """The one line of a request no handler logged (model list, probes, refusals by auth)."""
    query = scope.get("query_string", b"").decode("latin-1")
    url = scope["path"] + (f"?{query}" if query else "")
    client = scope.get("client")
    log_request(
        rid, None, None, None, status, {}, None, None, seconds, scope["method"], url,
        header(scope, b"user-agent") or None, size,
        trace_header=header(scope, b"x-cloud-trace-context") or header(scope, b"traceparent"),
        remote_ip=client[0] if client else None, quiet=_quiet(scope["path"], status),
    )  # fmt: skip


def _quiet(path: str, status: int) -> bool:
    """A probe or scrape answered as expected (not ready yet is an expected answer)."""
    quiet = path in QUIET_PATHS or path.startswith("/page/")
    return quiet and (status < 400 or (path == "/readyz" and status == 503))


def header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return ""


def _decorate(headers: MutableHeaders, rid: str, started: float) -> None:
    headers["X-Request-Id"] = rid
    if "server-timing" not in headers:
        headers["Server-Timing"] = f"total;dur={(time.perf_counter() - started) * 1000:.2f}"
    for name, value in SECURITY_HEADERS.items():
        headers.setdefault(name, value)
    headers.setdefault("Content-Security-Policy", API_CSP)
