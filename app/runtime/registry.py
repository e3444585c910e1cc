"""The registry: the served parts, loaded from the store and gated at startup.

Every entry's decoder, and its encoder where it holds one, goes through the same steps:
hash (the weights' sha256), map (memory-map them into the exact float32 module), build (its
probes, with the stored gate reference where it is valid), then gate: every candidate mode
measured and the fastest that passes served (``app/runtime/selection.py``). On the CPU with
``VAE_DTYPE=auto`` the exact path serves first and the modes are measured after ready.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.config import Settings
from app.runtime import device as devices
from app.runtime import gate, modes, references, selection
from app.runtime.parts import DECODER, ENCODER, ModelState, ServedPart
from app.store import Manifest, StoreError, check_pair, list_models, load_part, verify_part
from app.telemetry import timing
from app.telemetry.metrics import ENCODE_OUTPUTS, IMAGE_OUTPUTS, VIDEO_OUTPUTS, Metrics

log = logging.getLogger("app.runtime.registry")


@dataclass
class _Entry:
    """A part mapped and built, waiting for its gate."""

    name: str
    part: str
    folder: Path
    manifest: Manifest
    reference: nn.Module
    probes: gate.Probes
    status: str  # the stored gate reference as loaded: valid, missing, stale, tampered
    state: ModelState
    recomputed: bool = False  # the reference was computed again (and stored, if writable)


class Registry:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.models: dict[str, ServedPart] = {}  # the decoders
        self.encoders: dict[str, ServedPart] = {}  # the entries' encoders, where they hold one
        self.errors: dict[str, str] = {}  # model -> why it is not served
        self.encoder_errors: dict[str, str] = {}  # model -> why its encoder is not served
        self.states: dict[str, ModelState] = {}  # every configured model, served or not
        self.pending: list[_Entry] = []  # served on the exact path until their modes are measured
        self.loading = True
        self.stopping = False  # the service is shutting down: measure no more modes
        self.device = torch.device("cpu")

    # --- loading --------------------------------------------------------------------------
    def load_all(self) -> None:
        """Load every configured entry and run its gates (a failing one is reported). The next
        entries are hashed and memory-mapped on a second thread while one gates."""
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
        workers = 1 if self.settings.load_prefetch else 0
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="model-prefetch") as pool:
            if workers:  # one thread maps the decoders in order, ahead of the gates
                ahead = [pool.submit(self._map, store, n, DECODER, self.states[n]) for n in names]
            for i, name in enumerate(names):
                state = self.states[name]
                try:
                    entry = ahead[i].result() if workers else self._map(store, name, DECODER, state)
                    self.models[name] = self._serve(entry)
                    self.errors.pop(name, None)
                    state.enter("ready")
                except Exception as exc:  # one broken entry is reported; the others still load
                    self.errors[name] = str(exc)
                    state.enter("failed", str(exc))
                    log.error("model %s not served: %s", name, exc)
                    continue
                self._load_encoder(store, name, entry.manifest)
        self._check_default()

    def _check_default(self) -> None:
        """A ``VAE_DEFAULT_MODEL`` that names no configured entry is said at startup (requests
        that name no model are then a 404), not only to the first such request."""
        name = self.settings.default_model
        if name is not None and name not in self.states:
            log.warning(
                "VAE_DEFAULT_MODEL=%s names no model this service loads (%s): a request that "
                "names no model gets a 404",
                name,
                ", ".join(self.states) or "none",
            )

    def _load_encoder(self, store: Path, name: str, manifest: Manifest) -> None:
        """The entry's encoder, through the same steps (``VAE_SERVE_ENCODERS=false``: none)."""
        if not self.settings.serve_encoders or ENCODER not in manifest.parts:
            return
        state = ModelState()
        try:
            entry = self._map(store, name, ENCODER, state)
            check_pair(name, self.models[name].reference, entry.reference)  # older stores
            self.encoders[name] = self._serve(entry)
            state.enter("ready")
        except Exception as exc:  # the entry's decoder is still served
            self.encoder_errors[name] = str(exc)
            state.enter("failed", str(exc))
            log.error("encoder of %s not served: %s", name, exc)

    def _map(self, store: Path, name: str, part: str, state: ModelState) -> _Entry:
        """hash (the weights' sha256), map (memory-map them), build (the float32 reference and
        its probes, with the stored gate reference where it is valid)."""
        with state.phase("hash"):
            if self.settings.verify_weights:
                verify_part(store, name, part)
        with state.phase("map"):
            manifest, module = load_part(store, name, part, verify=False)
        with state.phase("build"):
            reference = module.float() if _has_non_float32(module) else module
            timing.instrument(selection.stages(reference))
            probes = gate.probes_for(reference, self._full_on(), self._memory_cap())
            folder, status = references.load(store, name, part, manifest, probes)
        return _Entry(name, part, folder, manifest, reference, probes, status, state)

    def _serve(self, entry: _Entry) -> ServedPart:
        """The part served now: gated, or (its modes measured after ready) its exact path."""
        if self.select_after_ready():
            self.pending.append(entry)
            return self._exact(entry)
        return self._gate(entry)

    def _full_on(self) -> torch.device | None:
        """Where the gate's full-resolution check runs (``VAE_GATE_FULL``), or None."""
        setting = self.settings.gate_full
        on = setting == "on" or (setting == "auto" and self.device.type == "cuda")
        return self.device if on else None

    def _memory_cap(self) -> int:
        return self.settings.device_memory_bytes()

    def select_after_ready(self) -> bool:
        """``VAE_SELECT=auto``: on the CPU with ``VAE_DTYPE=auto`` the exact path serves first
        (it needs no gate: it is the reference) and the faster modes are measured after ready;
        on a GPU the CPU path is no stand-in, so the modes are measured before ready."""
        setting = self.settings.select
        if setting != "auto":
            return setting == "after_ready"
        return self.settings.dtype == "auto" and self.device.type == "cpu"

    def select_pending(self) -> None:
        """Measure and gate the candidate modes of the parts served on the exact path for now;
        each winner replaces its part (a run in flight keeps the one it took)."""
        while self.pending and not self.stopping:
            entry = self.pending.pop(0)
            served = self.encoders if entry.part == ENCODER else self.models
            entry.state.selection = "measuring"
            try:
                chosen = self._gate(entry, upgrade=True)
                chosen.compiled = served[entry.name].compiled
                served[entry.name] = chosen
                self._publish(entry, chosen)  # "done" once the winner serves, not before
            except selection.Interrupted as exc:  # shutting down, between two timed runs
                entry.state.selection = "stopped"
                log.info("%s", exc)
            except Exception as exc:  # the exact path keeps serving
                entry.state.selection = f"failed: {exc}"
                log.error(
                    "%s: mode selection failed, serving the exact path: %s", _what(entry), exc
                )

    # --- gating ---------------------------------------------------------------------------
    def _exact(self, entry: _Entry) -> ServedPart:
        """The part on its exact float32 CPU path, ungated (it is the reference)."""
        entry.state.selection = "pending"
        self._export(entry, 1.0, False)
        served = ServedPart(
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
            state=entry.state,
        )
        served.load_seconds = entry.state.elapsed()
        return served

    def _gate(self, entry: _Entry, upgrade: bool = False) -> ServedPart:
        state = entry.state
        if not upgrade:
            state.enter("gating")
        candidates = modes.candidate_modes(self.settings.dtype, self.device)
        with state.phase("select" if upgrade else "gate"):  # after ready: its own phase
            # nothing to gate on the exact path alone: no reference outputs, nothing timed
            if entry.status != "valid" and not selection.exact_only(candidates, self.device):
                references.recompute(
                    entry.folder, entry.manifest, entry.part, entry.probes, entry.status
                )
                entry.recomputed = True
            chosen = selection.choose(
                _what(entry),
                entry.probes,
                self.device,
                candidates,
                self.settings.parity_min_cos,
                self.settings.gate_repeats,
                stop=(lambda: self.stopping) if upgrade else (lambda: False),
            )
        served = self._served(entry, chosen)
        served.load_seconds = state.elapsed()
        if not upgrade:  # an upgrade is published by select_pending, once swapped in
            self._publish(entry, served)
        return served

    def _publish(self, entry: _Entry, served: ServedPart) -> None:
        """The part's selection done (``/models``) and its metrics, once it is the one served."""
        entry.state.selection = "done"
        self._export(entry, served.gate.cosine, served.fallback)

    def _served(self, entry: _Entry, chosen: selection.Selection) -> ServedPart:
        candidate, min_cos = chosen.chosen, self.settings.parity_min_cos
        report = candidate.report or gate.GateReport()
        reason = ""
        if not chosen.passed:
            dtype = str(candidate.mode.dtype).removeprefix("torch.")
            reason = f"parity cosine {report.cosine:.6f} < {min_cos} on {self.device.type}/{dtype}"
            if self.settings.fallback == "off":
                self._export(entry, report.cosine, False)  # the cosine, though not served
                raise RuntimeError(f"{_what(entry)}: {reason} and VAE_FALLBACK=off")
            log.warning("%s served on the float32 CPU fallback: %s", _what(entry), reason)
        fast = candidate.copy or entry.reference
        # a tiled run goes to the fast copy only where the gate checked its tiles (an encoder's
        # probes have no tiled check yet: its tiled encodes run on the exact path)
        tiles, checked = getattr(fast, "supports_tiling", False), entry.probes.tiled is not None
        tiled_gated = fast is entry.reference or (
            report.tiled_passed(min_cos) and (checked or not tiles)
        )
        log.info(
            "%s: serving %s on %s (%s); gate reference %s",
            _what(entry),
            candidate.mode,
            self.device,
            chosen.why,
            f"{entry.status} at load, recomputed" if entry.recomputed else entry.status,
        )
        return ServedPart(
            entry.name,
            entry.manifest,
            entry.reference,
            fast,
            self.device,
            candidate.mode,
            report,
            not chosen.passed,
            reason,
            candidates=[c.describe(min_cos) for c in chosen.candidates],
            chosen_because=chosen.why,
            tiled_gated=bool(tiled_gated),
            tiled_probe_tiles=True if entry.probes.tiled is not None else None,
            full_check=_full_check(entry.probes, report),
            reference_status=entry.status,
            state=entry.state,
        )

    def _export(self, entry: _Entry, cosine: float, fallback: bool) -> None:
        """A part's metrics. A part served (its selection pending or done; one refused by
        ``VAE_FALLBACK=off`` only exports its cosine) has its request label sets created at 0
        before any request can count under its name (``Metrics.init_labels``). A decoder's
        gauges: parity, fallback and, once served, ``vae_model_load_seconds`` by phase, where ``total`` is
        the time until it first served and the modes measured after ready (``VAE_SELECT``)
        are ``select``, not ``gate`` (docs/metrics.md)."""
        name, state = entry.name, entry.state
        served = state.selection in ("pending", "done")
        if served:
            if entry.part != DECODER:
                self.metrics.init_labels(name, ENCODE_OUTPUTS, refused_output=ENCODE_OUTPUTS[0])
            else:
                video = entry.reference.is_video
                self.metrics.init_labels(name, VIDEO_OUTPUTS if video else IMAGE_OUTPUTS)
        if entry.part != DECODER:
            return
        self.metrics.parity_cosine.labels(name).set(cosine)
        self.metrics.fallback_active.labels(name).set(int(fallback))
        if not served:  # its start never ended in a model served: no load time (the alert
            return  # on a replica with none, VaeNoReadyReplica, counts these)
        after_ready = state.state == "ready"  # select_pending: the exact path served first
        if not after_ready:
            self.metrics.model_load_seconds.labels(name, "total").set(state.elapsed())
        for phase, seconds in state.phases.items():
            self.metrics.model_load_seconds.labels(name, phase).set(seconds)

    # --- what the service reads -----------------------------------------------------------
    def describe_states(self) -> dict[str, dict[str, Any]]:
        return {name: state.describe() for name, state in self.states.items()}

    @property
    def ready(self) -> bool:
        """Every model loaded and gated (or, with VAE_READY_PARTIAL, at least one)."""
        if self.loading or not self.models:
            return False
        return not self.errors or self.settings.ready_partial


def _what(entry: _Entry) -> str:
    return f"model {entry.name}" if entry.part == DECODER else f"encoder of {entry.name}"


def _has_non_float32(module: nn.Module) -> bool:
    return any(p.dtype != torch.float32 for p in module.parameters())


def _full_check(probes: gate.Probes, report: gate.GateReport) -> str:
    if getattr(probes, "full", None) is None:
        return "off"
    if any(c.name == "full" for c in report.checks):
        return "run"
    return f"skipped: {probes.full_skipped}" if probes.full_skipped else "not run"


__all__ = ["Registry", "StoreError"]
