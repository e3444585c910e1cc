"""The served mode, chosen by measurement: every candidate mode runs the gate's plain probe
(best of a few timed repeats, taken in turns: ``retime``); the fastest whose outputs pass the
whole gate is served. Decoders and encoders are chosen alike (``gate.Probes`` runs either).

The candidates' order (``modes.candidate_modes``: where the CPU flags come in) only breaks
near-ties: a later candidate must be faster by more than ``TIE`` to win over an earlier one.
The plain-probe run is the gate's batch-1 check, so a candidate's timing costs no extra run;
the rest of the gate runs only on the candidates in order of their time, until one passes. A
single candidate that is the exact path itself is served unmeasured: nothing to choose, nothing
to gate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from app.families.encoder import VAEEncoder
from app.runtime import device as devices
from app.runtime import gate, modes
from app.runtime.modes import Mode
from app.telemetry import timing

log = logging.getLogger("app.runtime.selection")

TIE = 1.05  # a later candidate wins only when faster than an earlier one by more than this
# A first decode this much slower than the best: no more repeats. It spares the hopeless
# (emulated bf16 runs ten times slower and more), not a first decode's warm-up (docs/BENCHMARKS.md).
CLEARLY_SLOWER = 3.0
ENCODER_STAGE_PREFIX = "encoder."  # an encoder's phases: encoder.conv_in, ..., encoder.normalize


@dataclass
class Candidate:
    mode: Mode
    copy: nn.Module | None = None  # the part built in this mode (None: it failed)
    probe_seconds: float | None = None
    probe_cosine: float | None = None  # the batch-1 check
    report: gate.GateReport | None = None  # the whole gate, where it ran
    error: str = ""
    output: Tensor | None = field(default=None, repr=False)  # the gate's batch-1 output

    def passed(self, min_cos: float) -> bool:
        return self.report is not None and self.report.passed(min_cos)

    def describe(self, min_cos: float) -> dict[str, Any]:
        return {
            "mode": str(self.mode),
            "dtype": str(self.mode.dtype).removeprefix("torch."),
            "optimized": self.mode.optimized,
            "probe_seconds": None if self.probe_seconds is None else round(self.probe_seconds, 4),
            "probe_cosine": self.probe_cosine,
            "gated": self.report is not None,
            "passed": self.passed(min_cos) if self.report is not None else None,
            "parity_cosine": None if self.report is None else self.report.cosine,
            "error": self.error or None,
        }


@dataclass
class Selection:
    chosen: Candidate
    passed: bool
    why: str
    candidates: list[Candidate] = field(default_factory=list)


class Interrupted(Exception):
    """A measurement ended between two timed runs: the service is shutting down."""


def choose(
    name: str,
    probes: gate.Probes,
    device: torch.device,
    candidate_modes: list[Mode],
    min_cos: float,
    repeats: int = 2,
    stop: Callable[[], bool] = lambda: False,
) -> Selection:
    """Measure every candidate, then gate them fastest first; the first that passes wins.
    ``stop`` (the service shutting down) is asked before each timed run: ``Interrupted``."""
    reference = probes.reference
    if exact_only(candidate_modes, device):
        only = Candidate(modes.EXACT, reference, report=gate.EXACT_REPORT)
        return Selection(only, True, "the only candidate: the exact path", [only])

    def go_on() -> None:
        if stop():
            raise Interrupted(f"{name}: mode selection stopped: the service is shutting down")

    def timed(candidate: Candidate) -> float:
        go_on()
        return _run_seconds(candidate.copy, probes, device)[0]

    candidates = [Candidate(mode) for mode in candidate_modes]
    for candidate in candidates:
        go_on()
        _measure(candidate, probes, device)
    retime(candidates, timed, repeats)
    go_on()
    for candidate in candidates:
        log.info(
            "%s: candidate %s on %s: probe %s s, batch-1 cosine %s%s",
            name,
            candidate.mode,
            device,
            _fmt(candidate.probe_seconds, ".4f"),
            _fmt(candidate.probe_cosine, ".7f"),
            f" ({candidate.error})" if candidate.error else "",
        )
    try:
        return _gate_in_order(name, probes, candidates, min_cos)
    finally:
        for candidate in candidates:
            candidate.output = None


def exact_only(candidate_modes: list[Mode], device: torch.device) -> bool:
    """The exact path is the one candidate: it is the reference, nothing to time or gate."""
    return candidate_modes == [modes.EXACT] and device.type == "cpu"


def _gate_in_order(
    name: str, probes: gate.Probes, candidates: list[Candidate], min_cos: float
) -> Selection:
    for candidate in ranked(candidates):
        if candidate.probe_cosine is None or candidate.probe_cosine < min_cos:
            continue
        candidate.report = gate.run(candidate.copy, probes, candidate.output)
        if candidate.passed(min_cos):
            return Selection(candidate, True, why(candidate, candidates), candidates)
        log.info("%s: %s fails the gate: %s", name, candidate.mode, candidate.report)
    failed = [c for c in candidates if c.copy is not None] or candidates
    worst = max(failed, key=lambda c: c.report.cosine if c.report else (c.probe_cosine or -1))
    if worst.report is None and worst.copy is not None:
        worst.report = gate.run(worst.copy, probes)  # the fallback's reason needs a cosine
    return Selection(worst, False, "no candidate passes the gate", candidates)


def ranked(candidates: list[Candidate]) -> list[Candidate]:
    """Measured candidates, fastest first; within ``TIE`` the earlier in order goes first."""
    measured = [c for c in candidates if c.probe_seconds is not None]
    out: list[Candidate] = []
    remaining = list(measured)
    while remaining:
        fastest = min(c.probe_seconds for c in remaining)
        pick = next(c for c in remaining if c.probe_seconds <= fastest * TIE)
        out.append(pick)
        remaining.remove(pick)
    return out


def retime(
    candidates: list[Candidate], seconds: Callable[[Candidate], float], repeats: int
) -> None:
    """The timed repeats after each candidate's first: in turns over the candidates, so a load
    that comes and goes during the measurement falls on every candidate alike (and the first
    one does not pay the process's warm-up alone); each keeps its best. A candidate already
    ``CLEARLY_SLOWER`` than the best is not repeated, nor one measured alone (nothing to
    compare it with: a forced ``VAE_DTYPE``)."""
    for _ in range(max(1, repeats) - 1):
        measured = [c for c in candidates if c.probe_seconds is not None]
        if len(measured) < 2:
            return
        best = min(c.probe_seconds for c in measured)
        for candidate in measured:
            if candidate.probe_seconds <= best * CLEARLY_SLOWER:
                candidate.probe_seconds = min(candidate.probe_seconds, seconds(candidate))


def _measure(candidate: Candidate, probes: gate.Probes, device: torch.device) -> None:
    """Build the candidate's copy and time its first run of the probe (the gate's batch-1
    check)."""
    reference = probes.reference
    try:
        copy = modes.build(reference, device, candidate.mode)
        if copy is not reference:
            timing.instrument(stages(copy))
        seconds, out = _run_seconds(copy, probes, device)
        candidate.copy, candidate.probe_seconds, candidate.output = copy, seconds, out
        candidate.probe_cosine = probes.check_plain(copy, out).cosine
    except Exception as exc:  # a mode this device cannot run is not a candidate
        candidate.error = f"{type(exc).__name__}: {exc}"


def _run_seconds(
    copy: nn.Module, probes: gate.Probes, device: torch.device
) -> tuple[float, Tensor]:
    t0 = time.perf_counter()
    out = probes.run_plain(copy)
    devices.synchronize(device)
    return time.perf_counter() - t0, out


def stages(part: nn.Module) -> list[tuple[str, nn.Module]]:
    """A part's timed stages under their metric names (an encoder's are ``encoder.<stage>``)."""
    prefix = ENCODER_STAGE_PREFIX if isinstance(part, VAEEncoder) else ""
    return [(prefix + name, module) for name, module in part.stages()]


def why(chosen: Candidate, candidates: list[Candidate]) -> str:
    """Why ``chosen`` won over the other measured ``candidates``."""
    others = [c for c in candidates if c is not chosen and c.probe_seconds is not None]
    if not others:
        return "the only candidate"
    faster = [c for c in others if c.probe_seconds < chosen.probe_seconds]
    if not faster:
        return f"fastest on the probe ({chosen.probe_seconds:.4f} s)"
    if all(c.probe_seconds * TIE >= chosen.probe_seconds for c in faster):
        return f"within {TIE:.2f}x of the fastest and earlier in the order"
    return "the fastest that passes the gate"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)
