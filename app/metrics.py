"""Prometheus metrics. The names and labels are a contract (docs/metrics.md): dashboards and
alerts use them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# No `*_created` series: nothing here reads them, and Managed Prometheus bills every series.
disable_created_metrics()

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
# whole requests may run VAE_MAX_REQUEST_TIMEOUT_S (300 s) in the queue plus a long video decode
REQUEST_BUCKETS = (*PHASE_BUCKETS, 180, 300, 600)
SIZE_BUCKETS = tuple(2**k for k in range(10, 31, 2))


def code_class(code: int) -> str:
    """200 -> "2xx", 499 -> "4xx": the request histogram's outcome label."""
    return f"{code // 100}xx"


def _device_memory() -> dict[tuple[str, str], float]:
    from app.runtime.device import memory_bytes  # imported late: the runtime imports metrics

    return memory_bytes()


class DeviceMemory(Collector):
    """``vae_device_memory_bytes{device, kind}``, read when Prometheus scrapes."""

    def __init__(self, read: Callable[[], dict[tuple[str, str], float]] | None = None):
        self.read = read or _device_memory

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "vae_device_memory_bytes",
            "Device memory: allocated, reserved, peak, free, total (CUDA); the process's "
            "resident set as allocated and peak (cpu)",
            labels=["device", "kind"],
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        for (device, kind), value in sorted(self.read().items()):
            family.add_metric([device, kind], value)
        yield family


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
            "Seconds per decode request, end to end, every outcome",
            ["model", "output", "code_class"],
            buckets=REQUEST_BUCKETS,
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
            "Seconds of a model's start, by phase (hash, map, build, gate, compile; total)",
            ["model", "phase"],
            registry=r,
        )
        self.retries_total = Counter(
            "vae_retries",
            "Requests retried after a device failure",
            ["model", "reason", "path"],
            registry=r,
        )
        r.register(DeviceMemory())

    def observe_phases(self, model: str, device: str, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.phase_seconds.labels(model, phase, device).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
