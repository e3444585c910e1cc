"""What the process runs on: torch, its CUDA build, the driver and the device (the startup log
line), and the device's memory (read at each scrape by ``app.metrics``)."""

from __future__ import annotations

import logging
import resource
from pathlib import Path

import torch

log = logging.getLogger("app.devices")

NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")


def _driver() -> str:
    """The NVIDIA driver's version and the newest CUDA it supports, as far as can be read."""
    parts = []
    try:
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.216.03  ..."
        words = NVIDIA_DRIVER.read_text().split()
        parts.append(next(w for w in words if w[:1].isdigit() and w.count(".") >= 1))
    except (OSError, StopIteration):
        pass
    try:
        version = torch._C._cuda_getDriverVersion()  # e.g. 12020; no public API for it
        parts.append(f"CUDA {version // 1000}.{version % 1000 // 10}")
    except (AttributeError, RuntimeError):
        pass
    return " ".join(parts) or "unknown"


def runtime_summary(device_setting: str) -> str:
    """One line for the startup log: torch, its CUDA build, driver and device."""
    line = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none (CPU build)'}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        line += (
            f", driver {_driver()}, device cuda:0 {props.name} "
            f"({props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor})"
        )
    else:
        line += ", no CUDA device visible, device cpu"
    return line + f" (VAE_DEVICE={device_setting})"


def log_runtime(device_setting: str) -> None:
    """Log what the service runs on; warn when ``auto`` is about to decode on the CPU although
    torch is a CUDA build (a missing GPU or a driver too old for the build)."""
    log.info("runtime: %s", runtime_summary(device_setting))
    if device_setting == "auto" and torch.version.cuda and not torch.cuda.is_available():
        log.warning(
            "VAE_DEVICE=auto and torch is a CUDA %s build, but no GPU is usable: serving on "
            "the CPU (set VAE_DEVICE=cuda to refuse instead)",
            torch.version.cuda,
        )


def memory_bytes() -> dict[tuple[str, str], float]:
    """(device, kind) -> bytes. On a GPU: allocated, reserved, peak (max allocated), free and
    total, per CUDA device; the CPU: the process's resident set (current and peak)."""
    out: dict[tuple[str, str], float] = {}
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            name = f"cuda:{index}"
            free, total = torch.cuda.mem_get_info(index)
            out[(name, "allocated")] = torch.cuda.memory_allocated(index)
            out[(name, "reserved")] = torch.cuda.memory_reserved(index)
            out[(name, "peak")] = torch.cuda.max_memory_allocated(index)
            out[(name, "free")], out[(name, "total")] = free, total
    rss = _rss_bytes()
    out[("cpu", "allocated")] = rss
    # ru_maxrss is in KiB on Linux
    out[("cpu", "peak")] = max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return out


def _rss_bytes() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
