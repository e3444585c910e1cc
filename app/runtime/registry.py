"""The registry: the served models, loaded from the store and gated at startup.

Each model has its exact float32 CPU decoder (the source of truth and the fallback) and a
resident copy on the serving device in the fastest mode that passes the parity gate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from app.config import Settings
from app.decoders.base import VAEDecoder
from app.protocol import Limits, ModelGeometry
from app.runtime import device as devices
from app.runtime import gate, modes, references, selection
from app.runtime.modes import Mode
from app.store import (
    WEIGHTS,
    Manifest,
    StoreError,
    entry_dir,
    list_models,
    load_model,
    public_source,
    sha256_file,
)
from app.telemetry import timing
from app.telemetry.metrics import Metrics

log = logging.getLogger("app.runtime.registry")


STATES = ("loading", "gating", "ready", "failed")


@dataclass
class ModelState:
    """Where one model's start is (loading -> gating -> ready | failed), with times."""

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
class _Entry:
    """A store entry mapped and built, waiting for its gate."""

    name: str
    folder: Path
    manifest: Manifest
    reference: VAEDecoder
    probes: gate.Probes
    status: str  # the stored gate reference: valid, missing, stale, tampered


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
    candidates: list[dict[str, Any]] = field(default_factory=list)  # each mode's measurement
    chosen_because: str = ""
    # tiled decodes run on the fast copy only if its gate's tiled check passed
    tiled_gated: bool = True
    tiled_probe_tiles: bool | None = None  # the tiled check's probe is larger than one tile
    full_check: str = "off"  # the full-resolution check: off, run, or why it was skipped
    reference_status: str = ""  # the stored gate reference: valid, missing, stale, tampered
    state: ModelState | None = None

    def decoder_for(self, tiled: bool | None) -> VAEDecoder:
        """The decoder a decode with ``tiled`` runs on: never a path the gate did not check."""
        if tiled and not self.tiled_gated:
            return self.reference
        return self.active

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
            "mode": str(self.mode),
            "candidates": self.candidates,
            "chosen_because": self.chosen_because,
            "tiled_gated": self.tiled_gated,
            "tiled_probe_tiles": self.tiled_probe_tiles,
            "full_check": self.full_check,
            "gate_reference": self.reference_status or None,
            **(self.state.describe() if self.state else {}),
        }


class Registry:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.models: dict[str, ServedModel] = {}
        self.errors: dict[str, str] = {}  # model -> why it is not served
        self.states: dict[str, ModelState] = {}  # every configured model, served or not
        self.pending: list[_Entry] = []  # served on the exact path until their modes are measured
        self.loading = True
        self.device = torch.device("cpu")

    def load_all(self) -> None:
        """Load every configured store entry and run its gate (a failing one is reported).
        The next entries are hashed and memory-mapped on a second thread while one gates."""
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
            self.states[name] = ModelState()
        defer = self.select_after_ready()
        workers = 1 if self.settings.load_prefetch else 0
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="model-prefetch") as pool:
            if workers:  # one thread maps the entries in order, ahead of the gates
                futures = [pool.submit(self._map, store, name) for name in names]
            for i, name in enumerate(names):
                state = self.states[name]
                try:
                    entry = futures[i].result() if workers else self._map(store, name)
                    self.models[name] = self._exact(entry) if defer else self._gate(entry)
                    self.pending += [entry] if defer else []
                    self.errors.pop(name, None)
                    state.enter("ready")
                except Exception as exc:  # one broken entry is reported; the others still load
                    self.errors[name] = str(exc)
                    state.enter("failed", str(exc))
                    log.error("model %s not served: %s", name, exc)

    def _full_on(self) -> torch.device | None:
        """Where the gate's full-resolution check runs (``VAE_GATE_FULL``), or None."""
        setting = self.settings.gate_full
        on = setting == "on" or (setting == "auto" and self.device.type == "cuda")
        return self.device if on else None

    def select_after_ready(self) -> bool:
        """``VAE_SELECT=auto``: on the CPU with ``VAE_DTYPE=auto`` the exact path serves first
        (it needs no gate: it is the reference) and the faster modes are measured after ready;
        on a GPU the CPU path is no stand-in, so the modes are measured before ready."""
        setting = self.settings.select
        if setting != "auto":
            return setting == "after_ready"
        return self.settings.dtype == "auto" and self.device.type == "cpu"

    def select_pending(self) -> None:
        """Measure and gate the candidate modes of the models served on the exact path for now;
        each winner replaces its model's entry (a decode in flight keeps the one it took)."""
        while self.pending:
            entry = self.pending.pop(0)
            state = self.states[entry.name]
            state.selection = "measuring"
            try:
                served = self._gate(entry, upgrade=True)
                served.compiled = self.models[entry.name].compiled
                self.models[entry.name] = served
                state.selection = "done"
            except Exception as exc:  # the exact path keeps serving
                state.selection = f"failed: {exc}"
                log.error(
                    "model %s: mode selection failed, serving the exact path: %s", entry.name, exc
                )

    def _exact(self, entry: _Entry) -> ServedModel:
        """The model on its exact float32 CPU path, ungated (it is the reference)."""
        state = self.states[entry.name]
        state.selection = "pending"
        self.metrics.parity_cosine.labels(entry.name).set(1.0)
        self.metrics.fallback_active.labels(entry.name).set(0)
        self._export_phases(entry.name, state)
        served = ServedModel(
            entry.name,
            entry.manifest,
            entry.reference,
            entry.reference,
            torch.device("cpu"),
            modes.EXACT,
            gate.EXACT_REPORT,
            False,
            chosen_because="the exact path, served while the candidate modes are measured",
            reference_status=entry.status,
            state=state,
        )
        served.load_seconds = state.elapsed()
        return served

    def _export_phases(self, name: str, state: ModelState) -> None:
        """``vae_model_load_seconds``: each phase so far, and the total until now."""
        self.metrics.model_load_seconds.labels(name, "total").set(state.elapsed())
        for phase, seconds in state.phases.items():
            self.metrics.model_load_seconds.labels(name, phase).set(seconds)

    def _map(self, store: Path, name: str) -> _Entry:
        """hash (the weights' sha256), map (memory-map them), build (the float32 reference and
        its probes, with the stored gate reference where it is valid)."""
        state = self.states[name]
        folder = entry_dir(store, name)
        with state.phase("hash"):
            if self.settings.verify_weights:
                _verify(folder, name)
        with state.phase("map"):
            manifest, decoder = load_model(store, name, verify=False)
        with state.phase("build"):
            reference = decoder.float() if _has_non_float32(decoder) else decoder
            timing.instrument(reference.stages())
            probes = gate.Probes(reference, self._full_on(), self.settings.device_memory_bytes())
            stored, status = references.read(folder, references.reference_key(manifest, probes))
            if stored is not None and set(stored) == set(probes.check_names()):
                probes.set_expected(stored)
            elif status == "valid":
                status = "stale"  # the gate's checks changed
        return _Entry(name, folder, manifest, reference, probes, status)

    def _gate(self, entry: _Entry, upgrade: bool = False) -> ServedModel:
        name, state = entry.name, self.states[entry.name]
        if not upgrade:
            state.enter("gating")
        with state.phase("gate"):
            if entry.status != "valid":
                references.recompute(entry.folder, entry.manifest, entry.probes, entry.status)
            chosen = selection.choose(
                name,
                entry.reference,
                entry.probes,
                self.device,
                modes.candidate_modes(self.settings.dtype, self.device),
                self.settings.parity_min_cos,
                self.settings.gate_repeats,
            )
        served = self._served(entry, chosen)
        served.load_seconds = state.elapsed()
        state.selection = "done"
        self.metrics.fallback_active.labels(name).set(int(served.fallback))
        self._export_phases(name, state)
        return served

    def _served(self, entry: _Entry, chosen: selection.Selection) -> ServedModel:
        name, candidate = entry.name, chosen.chosen
        report = candidate.report or gate.GateReport()
        self.metrics.parity_cosine.labels(name).set(report.cosine)
        reason = ""
        if not chosen.passed:
            reason = (
                f"parity cosine {report.cosine:.6f} < {self.settings.parity_min_cos} on "
                f"{self.device.type}/{str(candidate.mode.dtype).removeprefix('torch.')}"
            )
            if self.settings.fallback == "off":
                raise RuntimeError(f"{name}: {reason} and VAE_FALLBACK=off")
            log.warning("model %s served on the float32 CPU fallback: %s", name, reason)
        fast = candidate.decoder or entry.reference
        tiled_gated = fast is entry.reference or report.tiled_passed(self.settings.parity_min_cos)
        log.info(
            "model %s: serving %s on %s (%s); gate reference %s",
            name,
            candidate.mode,
            self.device,
            chosen.why,
            entry.status,
        )
        return ServedModel(
            name,
            entry.manifest,
            entry.reference,
            fast,
            self.device,
            candidate.mode,
            report,
            not chosen.passed,
            reason,
            candidates=[c.describe(self.settings.parity_min_cos) for c in chosen.candidates],
            chosen_because=chosen.why,
            tiled_gated=bool(tiled_gated),
            tiled_probe_tiles=True if entry.probes.tiled is not None else None,
            full_check=_full_check(entry.probes, report),
            reference_status=entry.status,
            state=self.states[name],
        )

    def describe_states(self) -> dict[str, dict[str, Any]]:
        return {name: state.describe() for name, state in self.states.items()}

    @property
    def ready(self) -> bool:
        """Every model loaded and gated (or, with VAE_READY_PARTIAL, at least one)."""
        if self.loading or not self.models:
            return False
        return not self.errors or self.settings.ready_partial


def _verify(folder: Path, name: str) -> None:
    """The weights' sha256 against the manifest's (load_model reports a missing file)."""
    try:
        manifest = Manifest.read(folder)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise StoreError(f"{name}: unreadable manifest: {exc}") from exc
    weights = folder / WEIGHTS
    if weights.is_file() and sha256_file(weights) != manifest.sha256:
        raise StoreError(f"{name}: {WEIGHTS} does not match the manifest's sha256")


def _has_non_float32(module: torch.nn.Module) -> bool:
    return any(p.dtype != torch.float32 for p in module.parameters())


def _full_check(probes: gate.Probes, report: gate.GateReport) -> str:
    if probes.full is None:
        return "off"
    if any(c.name == "full" for c in report.checks):
        return "run"
    return f"skipped: {probes.full_skipped}" if probes.full_skipped else "not run"
