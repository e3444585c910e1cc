"""The served encoders: each store entry that holds one gets its exact float32 CPU encoder and
a served copy, chosen and gated like the decoders' (``app/runtime/selection.py``), and
``run_encode`` runs one encode on the decode worker.

The candidate modes are the decoders' (``modes.candidate_modes``: ``VAE_DTYPE``). Each
candidate encodes the family's seeded ``probe_input`` (best of ``VAE_GATE_REPEATS``) and is
compared with the exact encoder's moments (mean and logvar, or TAESD's latent); the fastest
whose cosine reaches ``VAE_PARITY_MIN_COS`` is served (a later one in the order only when
faster by more than ``selection.TIE``). On the CPU with ``VAE_SELECT=auto`` the exact encoder
serves at once and the candidates are measured after ready, as the decoders' are. Kept apart
from ``registry`` (the decoders) so that each changes on its own; ``Runtime.load_all`` calls
``load_encoders`` once the decoders are in.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from app.decoders.ops import cosine
from app.encoders import encoder_module
from app.encoders.base import VAEEncoder
from app.protocol.request import EncodeRequest, EncodeScaling
from app.runtime import device as devices
from app.runtime import modes, selection
from app.runtime.gate import PROBE_SEED
from app.runtime.modes import Mode
from app.runtime.runner import NonFiniteOutput
from app.runtime.scheduler import Call
from app.store import load_encoder
from app.telemetry import timing
from app.telemetry.timing import PhaseTimer

log = logging.getLogger("app.runtime.encoders")
STAGE_PREFIX = "encoder."  # the encoder's phases: encoder.conv_in, ..., encoder.normalize


@dataclass
class Candidate:
    """One mode's copy, its best time on the probe and its moments' cosine."""

    mode: Mode
    encoder: VAEEncoder | None = None
    probe_seconds: float | None = None
    cosine: float | None = None
    error: str = ""

    def describe(self) -> dict[str, Any]:
        return {
            "mode": str(self.mode),
            "probe_seconds": None if self.probe_seconds is None else round(self.probe_seconds, 4),
            "parity_cosine": self.cosine,
            "error": self.error or None,
        }


@dataclass
class ServedEncoder:
    name: str
    reference: VAEEncoder  # float32 CPU: the source of truth and the fallback
    fast: VAEEncoder
    device: torch.device
    cosine: float
    fallback: bool
    reason: str = ""
    load_seconds: float = 0.0
    mode: Mode = modes.EXACT
    why: str = ""  # why the served mode won
    selection: str = "done"  # pending (the exact encoder serves meanwhile), measuring, done
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def active(self) -> VAEEncoder:
        return self.reference if self.fallback else self.fast

    @property
    def serving_device(self) -> str:
        return "cpu" if self.fallback else self.device.type

    def describe(self) -> dict[str, Any]:
        mode = modes.EXACT if self.active is self.reference else self.mode
        return {
            "family": self.reference.family,
            "latent_channels": self.reference.latent_channels,
            "spatial_scale": self.reference.spatial_scale,
            "temporal_scale": self.reference.temporal_scale,
            "video": self.reference.is_video,
            "device": self.serving_device,
            "dtype": str(mode.dtype).removeprefix("torch."),
            # "exact": the float32 CPU encoder itself; "optimized": the gated served copy
            "path": "exact" if self.active is self.reference else "optimized",
            "mode": str(mode),
            "chosen_because": self.why or None,
            "selection": self.selection,
            "candidates": [c.describe() for c in self.candidates],
            "parity_cosine": self.cosine,
            "fallback": self.fallback,
            "fallback_reason": self.reason or None,
            "load_seconds": round(self.load_seconds, 3),
        }


@dataclass(frozen=True)
class Policy:
    """How the served encoders are chosen: ``VAE_DTYPE``'s candidates, the gate's threshold,
    the timed repeats, and whether the measurement waits until after ready."""

    dtype: str = "auto"
    min_cos: float = 0.9999
    repeats: int = 2
    after_ready: bool = False


def load_encoders(
    store: Path, names: list[str], device: torch.device, policy: Policy, verify: bool = False
) -> tuple[dict[str, ServedEncoder], dict[str, str]]:
    """The encoders of the served entries that hold one, and why any that should failed."""
    from app.store import read_manifest

    served: dict[str, ServedEncoder] = {}
    errors: dict[str, str] = {}
    for name in names:
        try:
            _, manifest = read_manifest(store, name)
            if "encoder" in manifest.parts:
                served[name] = load_one(store, name, device, policy, verify)
        except Exception as exc:  # the entry's decoder is still served
            errors[name] = str(exc)
            log.error("encoder of %s not served: %s", name, exc)
    return served, errors


def load_one(
    store: Path, name: str, device: torch.device, policy: Policy, verify: bool = False
) -> ServedEncoder:
    t0 = time.perf_counter()
    manifest, state = load_encoder(store, name, verify)
    module = encoder_module(manifest.family)
    reference = module.Encoder(manifest.encoder_config).eval()
    reference.load_state_dict(state)
    reference.float()
    reference.requires_grad_(False)
    _instrument(reference)
    served = ServedEncoder(name, reference, reference, device, 1.0, False)
    if policy.after_ready and device.type == "cpu":
        served.selection = "pending"  # the exact encoder serves until select() has measured
    else:
        select(served, policy)
    served.load_seconds = time.perf_counter() - t0
    return served


def select(served: ServedEncoder, policy: Policy) -> None:
    """Measure every candidate mode of ``served`` and serve the fastest that passes the gate
    (else the exact CPU encoder, with the reason). A request in flight keeps its copy."""
    served.selection = "measuring"
    reference, device = served.reference, served.device
    candidates = measure(reference, device, modes.candidate_modes(policy.dtype, device), policy)
    passing = [c for c in candidates if c.cosine is not None and c.cosine >= policy.min_cos]
    ranked = selection.ranked(passing)
    served.candidates = candidates
    if ranked:
        chosen = ranked[0]
        served.fast, served.mode, served.cosine = chosen.encoder, chosen.mode, chosen.cosine
        served.why = selection.why(chosen, candidates)
        served.fallback, served.reason = False, ""
    else:
        worst = min((c.cosine for c in candidates if c.cosine is not None), default=float("nan"))
        served.fallback, served.cosine = True, worst
        served.reason = f"encoder parity cosine {worst:.6f} < {policy.min_cos} on {device.type}"
        log.warning(
            "encoder of %s served on the float32 CPU fallback: %s", served.name, served.reason
        )
    for candidate in candidates:  # only the served copy is kept
        if candidate.encoder is not served.fast:
            candidate.encoder = None
    served.selection = "done"
    log.info(
        "encoder of %s: %s (%s), parity cosine %.7f; probe %s",
        served.name,
        served.describe()["mode"],
        served.why or served.reason,
        served.cosine,
        ", ".join(f"{c.mode} {_seconds(c)}" for c in candidates),
    )


def measure(
    reference: VAEEncoder, device: torch.device, candidate_modes: list[Mode], policy: Policy
) -> list[Candidate]:
    """Each mode's copy, timed on the probe and compared with the exact encoder's moments:
    its cosine is the lowest of the probe alone and of both rows of a batch of 2 (the probe
    and a second seeded input), as a micro-batched request runs."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    probe, second = reference.probe_input(generator), reference.probe_input(generator)
    with torch.inference_mode():
        expected = [reference.moments(probe), reference.moments(second)]
    rewrites = type(reference).optimize is not VAEEncoder.optimize
    candidates = []
    for mode in candidate_modes:
        if mode.optimized and not rewrites and Mode(mode.dtype, False) in candidate_modes:
            continue  # the same copy as the exact one of this dtype
        candidate = Candidate(mode)
        try:
            candidate.encoder = build(reference, device, mode)
            got, candidate.probe_seconds = _timed(candidate.encoder, probe, device)
            batch, _ = _timed(candidate.encoder, torch.cat([probe, second]), device)
            pairs = [(got, expected[0]), (batch[:1], expected[0]), (batch[1:], expected[1])]
            candidate.cosine = min(cosine(a.float().cpu(), b) for a, b in pairs)
        except Exception as exc:  # a mode this family or device cannot run is not a candidate
            candidate.error = f"{type(exc).__name__}: {exc}"
            candidate.encoder = None
        candidates.append(candidate)
    selection.retime(candidates, lambda c: _timed(c.encoder, probe, device)[1], policy.repeats)
    return candidates


def build(reference: VAEEncoder, device: torch.device, mode: Mode) -> VAEEncoder:
    """The copy requests run on for ``mode``: the reference itself for the CPU exact mode,
    else a copy on ``device`` whose floating parameters take the mode's dtype (buffers, such
    as latent statistics, stay float32), with the family's rewrites when ``optimized``."""
    if device.type == "cpu" and mode == modes.EXACT:
        return reference
    cast = _cast_names(reference, mode.dtype)
    if mode.dtype != torch.float32 and not cast:
        raise ValueError(f"the family keeps every parameter in float32, none in {mode.dtype}")
    fast = copy.deepcopy(reference).to(device)
    for name, param in fast.named_parameters():
        if name in cast:
            param.data = param.data.to(mode.dtype)
    if mode.optimized:
        fast.optimize()
    _instrument(fast)
    return fast.eval().requires_grad_(False)


def _cast_names(reference: VAEEncoder, dtype: torch.dtype) -> set[str]:
    """The floating parameters a copy in ``dtype`` casts: all but those the family
    ``keeps_float32`` (MiniMax-H3's reference pins its whole encoder to float32)."""
    keeps = getattr(reference, "keeps_float32", lambda name: False)
    return {
        name
        for name, param in reference.named_parameters()
        if param.is_floating_point() and not (dtype != torch.float32 and keeps(name))
    }


@torch.inference_mode()
def _timed(encoder: VAEEncoder, x: Tensor, device: torch.device) -> tuple[Tensor, float]:
    x = x.to(device, _dtype(encoder))
    t0 = time.perf_counter()
    out = encoder.moments(x)
    devices.synchronize(device)
    return out, time.perf_counter() - t0


def _seconds(candidate: Candidate) -> str:
    if candidate.probe_seconds is None:
        return f"failed ({candidate.error})"
    return f"{candidate.probe_seconds:.4f} s (cos {candidate.cosine:.7f})"


def _dtype(encoder: VAEEncoder) -> torch.dtype:
    return next(encoder.parameters()).dtype


def _instrument(encoder: VAEEncoder) -> None:
    timing.instrument([(STAGE_PREFIX + name, module) for name, module in encoder.stages()])


class InvalidInput(ValueError):
    """The encoder refused the pixels (a shape its family cannot encode): a 422."""


class EncodeJob(Call):
    """An encode request on the decode worker's queue (a ``Call`` with the model named)."""

    def __init__(self, served: ServedEncoder, request: EncodeRequest, timer: PhaseTimer) -> None:
        super().__init__(lambda: run_encode(served, request, timer, self.enqueued))
        self.deadline = request.deadline
        self.model = served  # what error answers name (``model.name``)


@torch.inference_mode()
def run_encode(
    served: ServedEncoder, request: EncodeRequest, timer: PhaseTimer, enqueued: float | None = None
) -> Tensor:
    """One encode: pixels -> latent (mean or seeded sample) -> scaling -> layout, on the host."""
    if enqueued is not None:
        timer.add("queue", time.perf_counter() - enqueued)
    encoder = served.active
    device = next(encoder.parameters()).device
    timer.device = device
    with timer.active():
        with timer.device_phase("upload"):
            pixels = request.pixels.to(device, _dtype(encoder))
        generator = torch.Generator().manual_seed(request.seed) if request.sample else None
        try:
            z = encoder.encode(pixels, sample=request.sample, generator=generator)
        except ValueError as exc:  # the family's input checks run before any compute
            raise InvalidInput(str(exc)) from None
        with timer.device_phase(STAGE_PREFIX + "normalize"):
            z = scaled(encoder, z, request.scaling)
            if request.packed:
                z = pack_latents(z)
        with timer.device_phase("download"):
            latent = z.float().cpu()
    timer.resolve()
    if not bool(torch.isfinite(latent).all()):
        raise NonFiniteOutput("the encode produced NaN or infinity: check the factors")
    return latent


def scaled(encoder: VAEEncoder, z: Tensor, scaling: EncodeScaling) -> Tensor:
    """remote_encode's ``(z - shift) * scale``, or the model's own with ``do_scaling``."""
    if scaling.scaling_factor is not None or scaling.shift_factor is not None:
        scale = 1.0 if scaling.scaling_factor is None else scaling.scaling_factor
        return (z - (scaling.shift_factor or 0.0)) * scale
    return encoder.normalize(z) if scaling.model_default else z


def pack_latents(z: Tensor) -> Tensor:
    """FLUX's packed layout (``FluxPipeline._pack_latents``): ``[B,C,H,W]`` ->
    ``[B, (H/2)(W/2), 4C]``, each 2x2 patch's channels together."""
    b, c, h, w = z.shape
    z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return z.reshape(b, (h // 2) * (w // 2), c * 4)
