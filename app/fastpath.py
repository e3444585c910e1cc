"""Resident fast path and the parity gate.

Every model keeps its exact float32 CPU decoder (memory-mapped from the store): it is the
source of truth. The fast path is a copy on the serving device in the serving dtype, with
channels_last and the exact upsample-conv rewrite. At startup both decode a fixed, seeded
probe latent; the fast path is served only if the cosine of the two outputs reaches
``VAE_PARITY_MIN_COS``. Otherwise the model is served on the float32 CPU path
(``VAE_FALLBACK=cpu``) or kept not-ready (``VAE_FALLBACK=off``).
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass

import torch

from app.decoders.base import VAEDecoder
from app.decoders.ops import cosine

log = logging.getLogger("app.fastpath")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROBE_SEED = 20261130


def resolve_device(setting: str) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("VAE_DEVICE=cuda but no CUDA device is visible")
        return torch.device("cuda")
    return torch.device("cpu")


@dataclass(frozen=True)
class Path:
    """One way to serve a model: a dtype on the device, exact or with the fast-path tricks."""

    dtype: torch.dtype
    optimized: bool = True

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{'' if self.optimized else ' exact'}"


EXACT = Path(torch.float32, optimized=False)


def candidate_paths(setting: str, device: torch.device) -> list[Path]:
    """Paths to try, fastest first. ``float32`` on the CPU is always the exact path."""
    if setting == "float32" and device.type == "cpu":
        return [EXACT]
    if setting != "auto":
        return [Path(DTYPES[setting])]
    fast_bf16 = device.type == "cuda" or cpu_has_fast_bf16()
    return ([Path(torch.bfloat16)] if fast_bf16 else []) + [Path(torch.float32)]


def cpu_has_fast_bf16() -> bool:
    """bf16 GEMMs beat float32 only with native bf16 dot products (AVX512-BF16 or AMX);
    without them (AVX2) oneDNN emulates bf16 and a decode is many times slower.
    ``VAE_CPU_FAST_BF16=1|0`` overrides the detection (so the tests can take the branch
    this CPU would not)."""
    forced = os.environ.get("VAE_CPU_FAST_BF16", "").strip().lower()
    if forced in ("1", "true", "0", "false"):
        return forced in ("1", "true")
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def make_fast(reference: VAEDecoder, device: torch.device, path: Path) -> VAEDecoder:
    """A resident copy of the decoder for serving: device, dtype, channels_last, rewrites."""
    if device.type == "cpu" and path == EXACT:
        return reference  # the exact path is served as it is
    fast = copy.deepcopy(reference).to(device=device, dtype=path.dtype)
    if fast.channels_last:
        fast = fast.to(memory_format=torch.channels_last)
    if path.optimized:
        fast.optimize()
    return fast.eval().requires_grad_(False)


@dataclass
class GateResult:
    cosine: float
    passed: bool


@torch.inference_mode()
def parity_gate(fast: VAEDecoder, reference: VAEDecoder, min_cos: float) -> GateResult:
    """Decode the seeded probe on both paths; cosine in float64 of the flattened outputs."""
    if fast is reference:
        return GateResult(1.0, True)
    probe = reference.probe_latent(torch.Generator().manual_seed(PROBE_SEED))
    expected = reference.decode(probe)
    got = fast.decode(probe.to(next(fast.parameters()).device))
    cos = cosine(got, expected)
    return GateResult(cos, cos >= min_cos)
