"""``Serving``: the service's long-lived parts, built once by ``create_app`` and handed to
every route and handler, so none of them threads four objects through its helpers."""

from __future__ import annotations

from dataclasses import dataclass

from app.config import Settings
from app.http.drain import Drain
from app.runtime import Runtime
from app.telemetry.metrics import Metrics


@dataclass(frozen=True)
class Serving:
    """The runtime that decodes, the metrics it reports to, the settings and the drain."""

    runtime: Runtime
    metrics: Metrics
    settings: Settings
    drain: Drain
