"""Prometheus metrics. The names and labels are a contract (docs/metrics.md): dashboards and
alerts use them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from app.telemetry.gpu_stats import register_gpu_stats

# No `*_created` series: nothing here reads them, and Managed Prometheus bills every sample it
# ingests: each series exported costs one sample per scrape, whether it changes or not.
disable_created_metrics()

# Buckets are few on purpose: each bucket is one series per label set, and each series one billed
# sample per scrape. Series per replica and model: docs/metrics.md, "Series per replica".
# queue wait, device decode and encode of a request: 1 ms .. 1 min
SPAN_BUCKETS = (0.005, 0.025, 0.1, 0.5, 2.5, 10, 60)
# whole requests: the queue (VAE_MAX_REQUEST_TIMEOUT_S) plus the longest admitted decode, up to
# Cloud Run's request timeout (deploy/cloudrun/service.yaml: 3600 s)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60, 600, 3600)
SIZE_BUCKETS = tuple(4**k for k in range(7, 16))  # 16 KiB .. 1 GiB
# phases that are not the device's decode work (everything else is: upload .. download)
NOT_DECODE = frozenset({"parse", "queue", "encode", "preview"})
# an output's kind, the label of the per-request histograms (8 outputs -> 4 kinds)
OUTPUT_KIND = {"png": "image", "jpg": "image", "webp": "image", "tensor": "tensor",
               "uint8": "tensor", "unit_tensor": "tensor", "mp4": "mp4",
               "preview": "preview", "latent": "tensor"}  # fmt: skip


def output_kind(output: str) -> str:
    """An output label's kind: png -> image, uint8 -> tensor, - (none chosen) -> -."""
    return OUTPUT_KIND.get(output, "-")


class ByKind:
    """A histogram labelled ``(model, kind, ...)`` that callers label with the output, as they
    do the counter: ``labels(model, "png", ...)`` observes ``kind="image"``."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram

    def labels(self, model: str, output: str, *rest: str) -> Histogram:
        return self.histogram.labels(model, output_kind(output), *rest)


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)

# Label sets created at 0 before any request (``Metrics.init_labels``), so that a counter's first
# burst is an increase from 0 that rate() and increase() see, not the first sample of a new series
# (docs/metrics.md, "Series that exist from the start"). The codes the alerts watch: 429
# (VaeShedding), 500 and 503 (VaeErrorRatioHigh) ...
REFUSAL_CODES = ("429", "500", "503")
# ... the outputs a successful decode has (the request-rate panels group by model and output) ...
IMAGE_OUTPUTS = ("png", "jpg", "webp", "tensor", "uint8", "unit_tensor")
VIDEO_OUTPUTS = ("tensor", "uint8", "unit_tensor", "mp4")
ENCODE_OUTPUTS = ("latent",)  # an encode's output label, its refusals' too (app/http/encode.py)
# ... and the device-retry panel's paths (``app/runtime/runner.py``: reason "oom")
RETRY_PATHS = ("tiled", "cpu")


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
        # every phase's total and count (no buckets): the mean time a phase adds to a request
        self.phase_seconds = Summary(
            "vae_phase_seconds",
            "Seconds per request phase (sum and count; quantiles: vae_span_seconds)",
            ["model", "phase", "device"],
            registry=r,
        )
        self.span_seconds = Histogram(
            "vae_span_seconds",
            "Seconds a successful request spent queued, decoding on the device, encoding",
            ["model", "span"],
            buckets=SPAN_BUCKETS,
            registry=r,
        )
        self.request_seconds = ByKind(
            Histogram(
                "vae_request_seconds",
                "Seconds per decode request, end to end, every outcome",
                ["model", "kind", "code_class"],
                buckets=REQUEST_BUCKETS,
                registry=r,
            )
        )
        self.requests_total = Counter(
            "vae_requests", "Decode requests by outcome", ["model", "output", "code"], registry=r
        )
        self.response_bytes = ByKind(
            Histogram(
                "vae_response_bytes",
                "Response body bytes",
                ["model", "kind"],
                buckets=SIZE_BUCKETS,
                registry=r,
            )
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
        self.batch_rows = Histogram(
            "vae_batch_rows",
            "Latent rows per micro-batch the decode worker ran",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        r.register(DeviceMemory())
        register_gpu_stats(r)  # NVML utilization + memory; nothing on a CPU host
        # refusals that name no served model ("-"): a full queue or body budget, a shutdown
        self.init_labels("-", ())

    def init_labels(self, model: str, outputs: Iterable[str], refused_output: str = "-") -> None:
        """Create, at 0, the label sets of ``model`` that alerts and panels watch: a success per
        output in ``outputs``, a refusal (``REFUSAL_CODES``, labelled ``refused_output``: ``-``
        for a decode, which refuses before it chooses an output) and its device retries.
        Idempotent; the registry calls it when it serves a part (``app/runtime/registry.py``),
        before any request can be counted under the model's name."""
        for output in outputs:
            self.requests_total.labels(model, output, "200")
        for code in REFUSAL_CODES:
            self.requests_total.labels(model, refused_output, code)
        if model != "-":
            for path in RETRY_PATHS:
                self.retries_total.labels(model, "oom", path)

    def observe_phases(
        self, model: str, device: str, phases: dict[str, float], op: str = "decode"
    ) -> None:
        """A successful request's phases: each phase's total, and the three spans' quantiles.
        An encode request (``op="encode"``) has its device work in ``encoder.*`` phases and
        no ``decode`` span (docs/metrics.md)."""
        for phase, seconds in phases.items():
            self.phase_seconds.labels(model, phase, device).observe(seconds)
        decode = [s for phase, s in phases.items() if phase not in NOT_DECODE]
        if op == "decode" and decode:  # a preview decodes nothing: it must not pull it down
            self.span_seconds.labels(model, "decode").observe(sum(decode))
        for span in ("queue", "encode"):
            if span in phases:
                self.span_seconds.labels(model, span).observe(phases[span])

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
