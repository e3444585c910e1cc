"""Structured logs: one JSON object per line, with Cloud Logging's field names.

Cloud Run (and any Fluent Bit / Ops Agent) turns a JSON line on stdout/stderr into a log entry:
``severity`` and ``message`` become the entry's severity and summary, ``httpRequest`` becomes the
request shown in the Logs Explorer, ``logging.googleapis.com/trace`` links the entry to its trace,
and every other key stays searchable in ``jsonPayload``.

``configure_logging(json=...)`` installs the formatter on the root logger (text for a terminal);
``log_request(...)`` writes the one line per decode request. User input (URL, user agent, model
name) only ever travels as data: it is never part of a format string.
"""

from __future__ import annotations

import json as _json
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

from app.config import setting

REQUEST_LOGGER = "app.protocol.request"
TRACE_FIELD = "logging.googleapis.com/trace"
SPAN_FIELD = "logging.googleapis.com/spanId"
SAMPLED_FIELD = "logging.googleapis.com/trace_sampled"
SOURCE_FIELD = "logging.googleapis.com/sourceLocation"

# Cloud Logging's LogSeverity names for Python's levels.
SEVERITY = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING",
            logging.ERROR: "ERROR", logging.CRITICAL: "CRITICAL"}  # fmt: skip
MAX_URL, MAX_AGENT, MAX_FIELD = 2048, 512, 256

_CLOUD_TRACE = re.compile(r"^([0-9a-fA-F]{32})(?:/(\d{1,20}))?(?:;o=([01]))?$")
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_HANDLER_FLAG = "_vae_logging_json"
# C0 and C1 controls, DEL, and the Unicode line/paragraph separators: a CR/LF in a logged value
# would start a forged line in a text log; a NUL truncates some readers.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# A secret a client puts in a URL (``?token=...``) is refused as auth, but the URL is logged:
# the value of any query key that names a credential, and a bearer token anywhere in a line,
# is replaced before the line is written.
_SECRET_KEYS = r"[\w.-]*(?:token|key|secret|passw(?:or)?d|pwd|auth\w*|credential|signature|sig|session|jwt|bearer)[\w.-]*"
_SECRET_PARAM = re.compile(rf"(?i)((?:^|[?&;\s\"'])(?:{_SECRET_KEYS})=)[^&;\s\"'#]*")
_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+")
REDACTED = "REDACTED"


def escape_controls(text: str) -> str:
    """``text`` with every control character written as a visible escape (``\\x0d``)."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                         else f"\\u{ord(m.group()):04x}", text)  # fmt: skip


def redact(text: str) -> str:
    """``text`` with credentials in query strings and bearer tokens replaced by REDACTED."""
    return _BEARER.sub(rf"\1{REDACTED}", _SECRET_PARAM.sub(rf"\1{REDACTED}", text))


def _severity(levelno: int) -> str:
    if levelno in SEVERITY:
        return SEVERITY[levelno]
    if levelno < logging.DEBUG:
        return "DEFAULT"
    return SEVERITY[max(k for k in SEVERITY if k <= levelno)]


class TextFormatter(logging.Formatter):
    """A terminal's log line, its message's control characters escaped: a value carrying
    CR/LF cannot start a line of its own. (A traceback, appended after, keeps its newlines.)"""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        escaped = logging.makeLogRecord(record.__dict__)
        escaped.message = escape_controls(record.message)
        return super().formatMessage(escaped)

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """A log record -> one JSON object (no newlines inside) with Cloud Logging field names."""

    def format(self, record: logging.LogRecord) -> str:
        message = escape_controls(record.getMessage())
        if record.exc_info:
            # Error Reporting finds a stack trace in `message`
            message = f"{message}\n{self.formatException(record.exc_info)}"
        if record.stack_info:
            message = f"{message}\n{self.formatStack(record.stack_info)}"
        entry: dict[str, Any] = {
            "severity": _severity(record.levelno),
            "message": message,
            "time": datetime.fromtimestamp(record.created, UTC).isoformat().replace("+00:00", "Z"),
            "logger": record.name,
            SOURCE_FIELD: {
                "file": record.pathname,
                "line": str(record.lineno),
                "function": record.funcName,
            },
        }
        fields = getattr(record, "json_fields", None)
        if isinstance(fields, Mapping):
            entry.update(fields)
        return redact(_json.dumps(entry, ensure_ascii=False, separators=(",", ":"), default=str))


def json_from_env() -> bool:
    """``VAE_LOG_FORMAT=json|text``; unset: JSON on Cloud Run (``K_SERVICE`` set), else text."""
    fmt = setting("log_format")
    if fmt != "auto":
        return fmt == "json"
    return bool(os.environ.get("K_SERVICE"))


def configure_logging(json: bool | None = None, level: int = logging.INFO,
                      stream: TextIO | None = None) -> None:  # fmt: skip
    """Install one handler on the root logger: JSON lines, or text for a terminal.

    ``json=None`` reads ``VAE_LOG_FORMAT`` (see ``json_from_env``). Idempotent: calling it again
    replaces the handler it installed before. Pair it with ``uvicorn_kwargs(json)``.
    """
    if json is None:
        json = json_from_env()
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_FLAG, False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    setattr(handler, _HANDLER_FLAG, True)
    if json:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)


def uvicorn_kwargs() -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run``: uvicorn installs no handlers of its own (its
    loggers propagate to the root handler, JSON or text, redacted like every line) and its
    access log is off: the service writes the one line per request (``log_request``)."""
    return {"log_config": None, "access_log": False}


def _clip(value: Any, limit: int = MAX_FIELD) -> str:
    text = "" if value is None else escape_controls(str(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def trace_fields(header: str | None, project: str | None = None) -> dict[str, Any]:
    """``X-Cloud-Trace-Context`` (``TRACE/SPAN;o=1``) or W3C ``traceparent`` -> Cloud Logging's
    trace fields. Needs the project id (argument, or ``GOOGLE_CLOUD_PROJECT``); else nothing."""
    project = project or os.environ.get("GOOGLE_CLOUD_PROJECT") or setting("gcp_project")
    if not header or not project:
        return {}
    header = header.strip()
    if m := _TRACEPARENT.match(header):
        trace, span, sampled = m.group(1), m.group(2), int(m.group(3), 16) & 1 == 1
    elif m := _CLOUD_TRACE.match(header):
        trace, sampled = m.group(1).lower(), m.group(3) == "1"
        span = f"{int(m.group(2)) & 0xFFFFFFFFFFFFFFFF:016x}" if m.group(2) else None
    else:
        return {}
    out: dict[str, Any] = {TRACE_FIELD: f"projects/{project}/traces/{trace}",
                           SAMPLED_FIELD: sampled}  # fmt: skip
    if span:
        out[SPAN_FIELD] = span
    return out


def log_request(request_id: str, model: str | None, shape: Sequence[int] | None,
                output: str | None, status: int, phases_ms: Mapping[str, float],
                device: str | None, fallback: bool | None, latency_s: float, method: str,
                url: str, user_agent: str | None, response_size: int | None, *,
                trace_header: str | None = None, remote_ip: str | None = None,
                project: str | None = None, quiet: bool = False,
                logger: logging.Logger | None = None) -> dict[str, Any]:  # fmt: skip
    """Write the one structured line of a request; returns the fields it logged. ``quiet``: a
    probe or a scrape answered as expected, logged at DEBUG.

    ``phases_ms``: milliseconds per phase (``{k: s * 1000 for k, s in timer.phases().items()}``);
    ``latency_s``: end-to-end seconds; ``trace_header``: ``X-Cloud-Trace-Context`` or
    ``traceparent`` as received. Severity follows the status: 5xx ERROR, 4xx WARNING, else INFO.
    """
    status = int(status)
    http_request: dict[str, Any] = {
        "requestMethod": _clip(method, 16),
        "requestUrl": redact(_clip(url, MAX_URL)),
        "status": status,
        "latency": f"{max(0.0, float(latency_s)):.6f}s",
        "userAgent": _clip(user_agent, MAX_AGENT),
        "protocol": "HTTP/1.1",
    }
    if response_size is not None:
        http_request["responseSize"] = str(int(response_size))  # int64: a string in proto JSON
    if remote_ip:
        http_request["remoteIp"] = _clip(remote_ip, 64)
    fields: dict[str, Any] = {
        "httpRequest": http_request,
        "request_id": _clip(request_id, 64),
        "model": _clip(model) if model else None,
        "shape": [int(d) for d in shape] if shape is not None else None,
        "output": _clip(output, 32) if output else None,
        "status": status,
        "phases_ms": {_clip(k, 64): round(float(v), 3) for k, v in phases_ms.items()},
        "latency_ms": round(float(latency_s) * 1000, 3),
        "device": device,
        "fallback": None if fallback is None else bool(fallback),
    }
    fields.update(trace_fields(trace_header, project))
    # a 503 is load, a deadline or a shutdown (Retry-After), not a fault of the service
    level = logging.WARNING if status >= 400 and status != 500 else logging.INFO
    if status >= 500 and status != 503:
        level = logging.ERROR
    if quiet:
        level = logging.DEBUG
    # The format string is a constant; every value arrives as an argument.
    (logger or logging.getLogger(REQUEST_LOGGER)).log(
        level, "%s %s %d %.3fs id=%s", http_request["requestMethod"], http_request["requestUrl"],
        status, float(latency_s), fields["request_id"], extra={"json_fields": fields},
        stacklevel=2,
    )  # fmt: skip
    return fields
