"""A decode request's metrics and its one log line, once its whole body has been produced."""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import Request, Response

from app.http.serving import Serving
from app.telemetry.logs import log_request
from app.telemetry.metrics import code_class
from app.telemetry.timing import PhaseTimer


def finisher(
    request: Request,
    response: Response,
    name: str | None,
    serving: Serving,
    timer: PhaseTimer,
    started: float,
    op: str = "decode",
) -> Callable[[int], None]:
    """Metrics and the request's log line, once the whole body has been produced (once).
    ``op="encode"``: an encode request (its phases on the encoder's device)."""
    code = response.status_code
    model_label = response.headers.get("x-model", name or "-")
    output_label = response.headers.get("x-output", "-")
    runtime, metrics = serving.runtime, serving.metrics
    done = False

    def finish(size: int) -> None:
        nonlocal done
        if done:
            return
        done = True
        serving.drain.active -= 1
        elapsed, phases = time.perf_counter() - started, timer.phases()
        served = runtime.models.get(model_label)
        model_seen = model_label if served else "-"
        if code < 400 and served is not None:
            device = served.serving_device
            if op == "encode" and model_label in runtime.encoders:
                device = runtime.encoders[model_label].serving_device
            metrics.observe_phases(model_label, device, phases, op)
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


def server_timing(phases: dict[str, float], total: float) -> str:
    parts = [f"{name};dur={seconds * 1000:.2f}" for name, seconds in phases.items()]
    parts.append(f"total;dur={total * 1000:.2f}")
    return ", ".join(parts)
