"""The registry: the served models, loaded from the store and gated at startup.

Each model has its exact float32 CPU decoder (the source of truth and the fallback) and a
resident copy on the serving device in the fastest mode that passes the parity gate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from app import timing
from app.config import Settings
from app.decoders.base import VAEDecoder
from app.metrics import Metrics
from app.protocol import Limits, ModelGeometry
from app.runtime import device as devices
from app.runtime import gate, modes
from app.runtime.modes import Mode
from app.store import Manifest, list_models, load_model, public_source

log = logging.getLogger("app.runtime.registry")


@dataclass
class ServedModel:
    name: str
    manifest: Manifest
    reference: VAEDecoder  # float32 CPU: the source of truth and the fallback
    fast: VAEDecoder
    device: torch.device
    mode: Mode
    gate: gate.GateReport
    fallback: bool
    reason: str = ""
    load_seconds: float = 0.0
    # latent shape -> its compiled decode (app/runtime/compiled.py), gated like the fast copy
    compiled: dict[tuple[int, ...], Callable[[Tensor], Tensor]] = field(default_factory=dict)

    @property
    def active(self) -> VAEDecoder:
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
        """What the protocol checks a request against (the served decoder's memory estimate)."""
        return ModelGeometry.of(self.active)

    def describe(self) -> dict[str, Any]:
        serving_dtype = torch.float32 if self.fallback else self.mode.dtype
        return {
            "name": self.name,
            "family": self.manifest.family,
            "config": self.reference.summary(),
            "source": public_source(self.manifest.source),
            "store_dtype": self.manifest.dtype,
            "device": self.serving_device,
            "dtype": str(serving_dtype).removeprefix("torch."),
            # "exact": the float32 CPU reference itself; "optimized": the gated fast copy
            "path": "exact" if self.active is self.reference else "optimized",
            "parity_cosine": self.gate.cosine,
            "parity_psnr_db": gate._finite(self.gate.psnr_db),
            "parity_checks": self.gate.describe(),
            "fallback": self.fallback,
            "fallback_reason": self.reason or None,
            "load_seconds": round(self.load_seconds, 3),
            "compiled_shapes": [list(shape) for shape in self.compiled],
        }


class Registry:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.models: dict[str, ServedModel] = {}
        self.errors: dict[str, str] = {}  # model -> why it is not served
        self.loading = True
        self.device = torch.device("cpu")

    def load_all(self) -> None:
        """Load every configured store entry and run its gate (a failing one is reported).
        ``loading`` stays True: the runtime clears it once the warm-up is done too."""
        store = Path(self.settings.models_dir)
        names = self.settings.model_names() or list_models(store)
        if not names:
            self.errors["*"] = f"no models in the store {store} (run `python -m app bake`)"
        try:
            self.device = devices.resolve(self.settings.device)
            devices.prepare(self.device, self.settings.device_memory_bytes())
            log.info("serving on %s", self.device)
        except RuntimeError as exc:
            self.errors["*"] = str(exc)
            log.error("no model served: %s", exc)
            names = []
        for name in names:
            try:
                self.models[name] = self._load_one(store, name)
                self.errors.pop(name, None)
            except Exception as exc:  # one broken entry is reported; the others still load
                self.errors[name] = str(exc)
                log.error("model %s not served: %s", name, exc)

    def _load_one(self, store: Path, name: str) -> ServedModel:
        t0 = time.perf_counter()
        manifest, decoder = load_model(store, name, verify=self.settings.verify_weights)
        reference = decoder.float() if _has_non_float32(decoder) else decoder
        timing.instrument(reference.stages())
        fast, mode, report = self._gated_copy(name, reference)
        passed = report.passed(self.settings.parity_min_cos)
        self.metrics.parity_cosine.labels(name).set(report.cosine)
        reason = ""
        if not passed:
            reason = (
                f"parity cosine {report.cosine:.6f} < {self.settings.parity_min_cos} on "
                f"{self.device.type}/{str(mode.dtype).removeprefix('torch.')}"
            )
            if self.settings.fallback == "off":
                raise RuntimeError(f"{name}: {reason} and VAE_FALLBACK=off")
            log.warning("model %s served on the float32 CPU fallback: %s", name, reason)
        served = ServedModel(
            name, manifest, reference, fast, self.device, mode, report, not passed, reason
        )
        served.load_seconds = time.perf_counter() - t0
        self.metrics.fallback_active.labels(name).set(int(served.fallback))
        self.metrics.model_load_seconds.labels(name).set(served.load_seconds)
        return served

    def _gated_copy(
        self, name: str, reference: VAEDecoder
    ) -> tuple[VAEDecoder, Mode, gate.GateReport]:
        """The fastest mode whose copy passes the gate (else the last one tried)."""
        probes = gate.Probes(reference)
        fast, mode, report = reference, modes.EXACT, gate.EXACT_REPORT
        for mode in modes.candidate_modes(self.settings.dtype, self.device):
            fast = modes.build(reference, self.device, mode)
            timing.instrument(fast.stages())
            report = gate.run(fast, probes)
            log.info(
                "model %s: %s %s parity cosine %.7f, PSNR %.1f dB",
                name,
                self.device,
                mode,
                report.cosine,
                report.psnr_db,
            )
            if report.passed(self.settings.parity_min_cos):
                break
        return fast, mode, report

    @property
    def ready(self) -> bool:
        """Every model loaded and gated (or, with VAE_READY_PARTIAL, at least one)."""
        if self.loading or not self.models:
            return False
        return not self.errors or self.settings.ready_partial


def _has_non_float32(module: torch.nn.Module) -> bool:
    return any(p.dtype != torch.float32 for p in module.parameters())
