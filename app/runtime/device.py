"""The serving device: which one, what it is, how much memory a decode may take, and what its
errors mean (out of memory: retry smaller; a sticky CUDA error: the instance must go)."""

from __future__ import annotations

import logging
import os
import platform

import torch

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


def describe(device: torch.device) -> str:
    """One log line: torch, CUDA runtime and driver, the device."""
    text = f"torch {torch.__version__}, python {platform.python_version()}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        driver = _driver_version()
        text += (
            f", CUDA runtime {torch.version.cuda}, driver {driver}, {props.name} "
            f"({props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor})"
        )
    else:
        text += f", CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
        text += f", native bf16: {cpu_has_fast_bf16()}"
    return text


def _driver_version() -> str:
    try:
        import pynvml  # nvidia-ml-py, where installed

        pynvml.nvmlInit()
        return str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:
        return "unknown"


def cpu_has_fast_bf16() -> bool:
    """bf16 GEMMs beat float32 only with native bf16 dot products (AVX512-BF16 or AMX);
    without them (AVX2) oneDNN emulates bf16 and a decode is many times slower."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def memory_budget(device: torch.device, cap_bytes: int = 0) -> int | None:
    """Bytes one decode may still take on ``device``: what the driver has free plus what
    torch holds unused, within ``cap_bytes`` (0 = the card). None on the CPU (no budget)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    held_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    budget = free + held_unused
    if cap_bytes:
        budget = min(budget, cap_bytes - torch.cuda.memory_allocated(device))
    return max(0, budget)


def memory_stats(device: torch.device) -> dict[str, int]:
    """allocated, reserved, peak, free, total bytes of the device (CUDA only)."""
    free, total = torch.cuda.mem_get_info(device)
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak": torch.cuda.max_memory_allocated(device),
        "free": free,
        "total": total,
    }


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
