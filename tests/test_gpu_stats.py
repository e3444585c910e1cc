"""NVML gauges (app/telemetry/gpu_stats.py): present with a GPU, absent (not zero) without one."""

from __future__ import annotations

import sys

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from app.telemetry.gpu_stats import register_gpu_stats
from app.telemetry.metrics import Metrics

NVML_METRICS = ("vae_device_utilization_ratio", "vae_gpu_memory_bytes")


def _samples(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_without_pynvml_nothing_is_registered(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    registry = CollectorRegistry()
    assert register_gpu_stats(registry) is None
    assert generate_latest(registry) == b""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: see the GPU test")
def test_cpu_host_exports_no_gpu_series():
    text = Metrics().exposition().decode()
    for name in NVML_METRICS:
        assert not _samples(text, name), name
        assert f"# TYPE {name}" not in text, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_utilization_and_memory_from_nvml():
    pytest.importorskip("pynvml")
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):
        x = x @ x
        x = x / x.norm()
    torch.cuda.synchronize()
    text = Metrics().exposition().decode()
    (util,) = _samples(text, 'vae_device_utilization_ratio{device="cuda:0"')
    assert 0.0 <= float(util.rsplit(" ", 1)[1]) <= 1.0
    memory = {line.split('kind="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in _samples(text, 'vae_gpu_memory_bytes{device="cuda:0"')}  # fmt: skip
    free, total = torch.cuda.mem_get_info(0)
    assert memory["total"] == pytest.approx(total, rel=0.01)
    # this process holds x (64 MiB) and its CUDA context
    assert memory["used"] >= 64 * 2**20
    assert memory["used"] == pytest.approx(total - free, rel=0.05, abs=256 * 2**20)
