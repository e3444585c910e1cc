"""The GPU's own utilization and memory through NVML (``nvidia-ml-py``, module ``pynvml``).

Cloud Run has no DCGM exporter, so the service exports what NVML reports for its device:
``vae_device_utilization_ratio{device}`` and ``vae_gpu_memory_bytes{device, kind}`` (the whole
GPU, every process; ``vae_device_memory_bytes`` is torch's view of this process). Read when
Prometheus scrapes. Without a GPU, or without ``pynvml``, the collector exports nothing: a
panel shows "no data", never a made-up zero.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


def _nvml() -> Any | None:
    """The initialized ``pynvml`` module, or None when it is missing or finds no driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError: no driver / no device (a CPU host)
        log.debug("NVML unavailable: %s", exc)
        return None
    return pynvml


class NvmlStats(Collector):
    """One scrape = one NVML read per device (cuda:0, cuda:1, ... in NVML's order)."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.count = nvml.nvmlDeviceGetCount()

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        utilization = GaugeMetricFamily(
            "vae_device_utilization_ratio",
            "Share of the last sample period a kernel ran on the GPU (NVML)",
            labels=["device"],
        )
        memory = GaugeMetricFamily(
            "vae_gpu_memory_bytes",
            "GPU memory as NVML reports it, every process: used, total",
            labels=["device", "kind"],
        )
        return utilization, memory

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        utilization, memory = self._families()
        for index in range(self.count):
            device = f"cuda:{index}"
            try:
                handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
                rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
                info = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:  # a lost device: skip its sample, keep the scrape alive
                log.warning("NVML read of %s failed: %s", device, exc)
                continue
            utilization.add_metric([device], rates.gpu / 100.0)
            memory.add_metric([device, "used"], float(info.used))
            memory.add_metric([device, "total"], float(info.total))
        yield utilization
        yield memory


def register_gpu_stats(registry: CollectorRegistry) -> NvmlStats | None:
    """Export the NVML gauges into ``registry`` when a GPU and ``pynvml`` are there; returns the
    collector (None on a CPU host, where nothing is registered)."""
    nvml = _nvml()
    if nvml is None:
        return None
    stats = NvmlStats(nvml)
    if stats.count == 0:
        return None
    registry.register(stats)
    return stats
