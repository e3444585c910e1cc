"""Prometheus metrics. The names and labels are a contract: dashboards and alerts use them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PHASE_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    25,
    60,
    120,
)
SIZE_BUCKETS = tuple(2**k for k in range(10, 31, 2))


class Metrics:
    """One registry per service instance (tests start several in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.phase_seconds = Histogram(
            "vae_phase_seconds",
            "Seconds per request phase",
            ["model", "phase", "device"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "vae_request_seconds",
            "Seconds per decode request, end to end",
            ["model", "output"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.requests_total = Counter(
            "vae_requests", "Decode requests by outcome", ["model", "output", "code"], registry=r
        )
        self.response_bytes = Histogram(
            "vae_response_bytes",
            "Response body bytes",
            ["model", "output"],
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("vae_queue_depth", "Requests waiting for a worker", registry=r)
        self.inflight = Gauge("vae_inflight", "Requests being decoded", registry=r)
        self.parity_cosine = Gauge(
            "vae_parity_cosine",
            "Fast path vs float32 CPU path cosine at startup",
            ["model"],
            registry=r,
        )
        self.fallback_active = Gauge(
            "vae_fallback_active",
            "1 when the model is served on the float32 CPU fallback",
            ["model"],
            registry=r,
        )
        self.model_load_seconds = Gauge(
            "vae_model_load_seconds",
            "Seconds to load the model and pass its gate",
            ["model"],
            registry=r,
        )
        self.retries_total = Counter(
            "vae_retries",
            "Requests retried after a device failure",
            ["model", "reason", "path"],
            registry=r,
        )

    def observe_phases(self, model: str, device: str, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.phase_seconds.labels(model, phase, device).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
