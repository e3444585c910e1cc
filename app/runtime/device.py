"""The serving device: which one, what it is (the startup log line), its memory (the budget of
a run, the host's on the CPU; the ``vae_device_memory_bytes`` gauge), and what its errors mean
(out of memory: retry smaller; a sticky CUDA error: the instance must go)."""

from __future__ import annotations

import functools
import logging
import resource
import time
from pathlib import Path

import torch

from app.config import setting
from app.runtime import host_memory

log = logging.getLogger("app.runtime.device")

# Errors after which a CUDA context is unusable: every later call fails the same way.
STICKY_CUDA_ERRORS = (
    "device-side assert",
    "illegal memory access",
    "illegal instruction",
    "uncorrectable ecc",
    "unspecified launch failure",
    "misaligned address",
    "cuda error: an illegal",
    "cudaerrorlaunchfailure",
)


def resolve(setting: str) -> torch.device:
    """``VAE_DEVICE``: auto (CUDA when visible), cpu, or cuda (an error when none is visible)."""
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("VAE_DEVICE=cuda but no CUDA device is visible")
        return torch.device("cuda")
    return torch.device("cpu")


def prepare(device: torch.device, memory_cap_bytes: int = 0) -> None:
    """Process-wide settings for serving on ``device``: cuDNN picks the fastest algorithm per
    shape (the warm-up pays for the search), and an optional cap emulates a smaller card."""
    if device.type != "cuda":
        return
    torch.backends.cudnn.benchmark = True
    if memory_cap_bytes:
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, memory_cap_bytes / total), index)


def cpu_has_fast_bf16() -> bool:
    """bf16 GEMMs beat float32 only with native bf16 dot products (AVX512-BF16 or AMX): bf16
    candidates first in ``auto``'s order where the flags say so (the order only breaks
    near-ties of the measured times). ``VAE_CPU_FAST_BF16=1|0`` overrides the detection (so
    the tests can take the branch this CPU would not)."""
    forced = setting("cpu_fast_bf16")
    if forced is not None:
        return forced
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# A bf16 convolution this many times slower than float32 is emulated: without oneDNN's bf16
# kernels (AVX2-only CPUs) PyTorch falls back to a reference loop hundreds of times slower,
# whose column buffers the memory estimates do not model.
BF16_EMULATED = 4.0


@functools.cache
def cpu_bf16_slowdown() -> float:
    """How many times longer a small convolution takes in bf16 than in float32 on this CPU,
    measured once per process (well under a second even where bf16 is emulated)."""
    conv = torch.nn.Conv2d(32, 32, 3, padding=1)
    x = torch.randn(1, 32, 64, 64, generator=torch.Generator().manual_seed(0))
    seconds = {}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            layer, inp = conv.to(dtype), x.to(dtype)
            layer(inp)  # the first call pays for the kernel's setup
            runs = []
            for _ in range(2):
                t0 = time.perf_counter()
                layer(inp)
                runs.append(time.perf_counter() - t0)
            seconds[dtype] = min(runs)
    return seconds[torch.bfloat16] / max(seconds[torch.float32], 1e-9)


def cpu_emulates_bf16() -> bool:
    """A bf16 convolution measured over ``BF16_EMULATED`` times float32's on this CPU."""
    return cpu_bf16_slowdown() > BF16_EMULATED


def cpu_offers_bf16() -> bool:
    """Whether ``auto`` measures bf16 candidates on the CPU: not where bf16 is emulated (it
    could not win, and measuring it would take the cores for minutes), unless
    ``VAE_CPU_FAST_BF16`` is set (then they are measured in the order it says)."""
    if setting("cpu_fast_bf16") is not None:
        return True
    if cpu_emulates_bf16():
        _log_emulated()
        return False
    return True


@functools.cache
def _log_emulated() -> None:
    """Once per process."""
    log.info(
        "bf16 is emulated on this CPU (a bf16 convolution took %.0fx float32's time): "
        "auto measures float32 candidates only",
        cpu_bf16_slowdown(),
    )


def memory_budget(device: torch.device, cap_bytes: int = 0) -> int:
    """Bytes one run may still take on ``device``, within ``cap_bytes`` (0: no cap). A GPU:
    what the driver has free plus what torch holds unused, the cap less what torch holds. The
    CPU: what the host (its cgroup) has available, the cap less the resident set."""
    if device.type != "cuda":
        budget = host_memory.available()
        if cap_bytes:
            budget = min(budget, cap_bytes - host_memory.resident())
        return max(0, budget)
    free, total = torch.cuda.mem_get_info(device)
    held_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    budget = free + held_unused
    if cap_bytes:
        budget = min(budget, cap_bytes - torch.cuda.memory_allocated(device))
    return max(0, budget)


def memory_capacity(device: torch.device, cap_bytes: int = 0) -> int:
    """Bytes ``device`` has at all, within ``cap_bytes`` (0: no cap): a GPU's total memory
    (its cached properties: the request handlers ask, and make no CUDA call); the CPU's, the
    host's within its cgroup's limit."""
    if device.type != "cuda":
        total = host_memory.total()
    else:
        total = torch.cuda.get_device_properties(device).total_memory
    return min(total, cap_bytes) if cap_bytes else total


def is_oom(exc: BaseException) -> bool:
    """A device out-of-memory error, or the CPU allocator's (a plain RuntimeError)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def is_sticky(exc: BaseException) -> bool:
    """A CUDA error that poisons the context (device-side assert, ECC...): not recoverable."""
    if is_oom(exc) or not isinstance(exc, RuntimeError):  # AcceleratorError is one too
        return False
    text = str(exc).lower()
    return any(marker in text for marker in STICKY_CUDA_ERRORS)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_cached(device: torch.device) -> None:
    """After an out-of-memory error: hand torch's cached blocks back before the retry."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
    rss = host_memory.resident()
    out[("cpu", "allocated")] = rss
    # ru_maxrss is in KiB on Linux
    out[("cpu", "peak")] = max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return out
