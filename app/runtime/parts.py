"""A served part: one direction of a store entry (its decoder or its encoder), resident.

Each part has its exact float32 CPU module (the source of truth and the fallback) and a copy on
the serving device in the fastest mode that passed the parity gate. Decoders and encoders are
served alike: built, gated, chosen (``app/runtime/selection.py``), planned and scheduled by the
same code; only the probes (``app/runtime/gate.py``) and the work (``app/runtime/runner.py``)
differ by direction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from app.families.encoder import VAEEncoder
from app.protocol import Limits, ModelGeometry
from app.runtime import gate
from app.runtime.modes import Mode
from app.store import Manifest, public_source

DECODER, ENCODER = "decoder", "encoder"


@dataclass
class ModelState:
    """Where one part's start is (loading -> gating -> ready | failed), with times."""

    state: str = "loading"
    started: float = field(default_factory=time.perf_counter)
    entered: dict[str, float] = field(default_factory=lambda: {"loading": 0.0})
    phases: dict[str, float] = field(default_factory=dict)  # hash, map, build, gate, compile
    error: str = ""
    selection: str = ""  # the served mode's measurement: pending, measuring, done

    def enter(self, state: str, error: str = "") -> None:
        self.state, self.error = state, error
        self.entered[state] = round(self.elapsed(), 3)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = round(self.phases.get(name, 0.0) + time.perf_counter() - t0, 4)

    def describe(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "state_seconds": dict(self.entered),  # since its load began, when each was entered
            "phase_seconds": dict(self.phases),
            "selection": self.selection or None,
            **({"error": self.error} if self.error else {}),
        }


@dataclass
class ServedPart:
    """One part as it is served: the exact module, the gated copy, and how it was chosen."""

    name: str  # the store entry
    manifest: Manifest
    reference: nn.Module  # float32 CPU: the source of truth and the fallback
    fast: nn.Module
    device: torch.device
    mode: Mode
    gate: gate.GateReport
    fallback: bool
    reason: str = ""
    load_seconds: float = 0.0
    # input shape -> its compiled run (app/runtime/compiled.py), gated like the fast copy
    compiled: dict[tuple[int, ...], Callable[[Tensor], Tensor]] = field(default_factory=dict)
    candidates: list[dict[str, Any]] = field(default_factory=list)  # each mode's measurement
    chosen_because: str = ""
    # tiled runs go to the fast copy only if its gate's tiled check passed
    tiled_gated: bool = True
    tiled_probe_tiles: bool | None = None  # the tiled check's probe is larger than one tile
    full_check: str = "off"  # the full-resolution check: off, run, or why it was skipped
    reference_status: str = ""  # the stored gate reference: valid, missing, stale, tampered
    state: ModelState | None = None

    @property
    def part(self) -> str:
        return ENCODER if isinstance(self.reference, VAEEncoder) else DECODER

    def decoder_for(self, tiled: bool | None) -> nn.Module:
        """The module a run with ``tiled`` goes to: never a path the gate did not check."""
        if tiled and not self.tiled_gated:
            return self.reference
        return self.active

    @property
    def active(self) -> nn.Module:
        return self.reference if self.fallback else self.fast

    @property
    def serving_device(self) -> str:
        return "cpu" if self.fallback else self.device.type

    @property
    def parity_cosine(self) -> float:
        return self.gate.cosine

    def limits(self, server: Limits) -> Limits:
        """The server's limits, tightened by the manifest config's own (if it sets any)."""
        return server.tightened(self.manifest.config)

    @property
    def geometry(self) -> ModelGeometry:
        """What the protocol checks a decode request against (the served decoder's memory
        estimate)."""
        return ModelGeometry.of(self.active)

    def describe(self) -> dict[str, Any]:
        """``GET /models``: the decoder's entry (the encoder's is nested in it as ``encoder``)."""
        serving_dtype = torch.float32 if self.fallback else self.mode.dtype
        return {
            "name": self.name,
            "family": self.manifest.family,
            "config": summary(self.reference),
            **(summary(self.reference) if self.part == ENCODER else {}),
            "source": public_source(self.manifest.source),
            "store_dtype": self.manifest.dtype,
            "device": self.serving_device,
            "dtype": str(serving_dtype).removeprefix("torch."),
            # "exact": the float32 CPU module itself; "optimized": the gated fast copy
            "path": "exact" if self.active is self.reference else "optimized",
            "parity_cosine": self.gate.cosine,
            "parity_psnr_db": gate._finite(self.gate.psnr_db),
            "parity_checks": self.gate.describe(),
            "fallback": self.fallback,
            "fallback_reason": self.reason or None,
            "load_seconds": round(self.load_seconds, 3),
            "compiled_shapes": [list(shape) for shape in self.compiled],
            "mode": str(self.mode),
            "candidates": self.candidates,
            "chosen_because": self.chosen_because,
            "tiled_gated": self.tiled_gated,
            "tiled_probe_tiles": self.tiled_probe_tiles,
            "full_check": self.full_check,
            "gate_reference": self.reference_status or None,
            **(self.state.describe() if self.state else {}),
        }


def summary(module: nn.Module) -> dict[str, Any]:
    """A part's geometry for ``/models``."""
    if isinstance(module, VAEEncoder):
        return {
            "latent_channels": module.latent_channels,
            "spatial_scale": module.spatial_scale,
            "temporal_scale": module.temporal_scale,
            "video": module.is_video,
        }
    return module.summary()
