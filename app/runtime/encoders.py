"""The served encoders: each store entry that holds one gets its exact float32 CPU encoder and
a served copy gated like the decoders, and ``run_encode`` runs one encode on the decode worker.

The gate compares the served copy's moments (mean and logvar, or TAESD's latent) with the
exact encoder's on the family's seeded ``probe_input``: the copy is served when their cosine
reaches ``VAE_PARITY_MIN_COS``, else the exact encoder is (the fallback). Kept apart from
``registry`` (the decoders) so that each changes on its own; ``Runtime.load_all`` calls
``load_encoders`` once the decoders are in.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from app import timing
from app.decoders.ops import cosine
from app.encoders import encoder_module
from app.encoders.base import VAEEncoder
from app.request import EncodeRequest, EncodeScaling
from app.runtime.gate import PROBE_SEED
from app.runtime.runner import NonFiniteOutput
from app.runtime.scheduler import Call
from app.store import load_encoder
from app.timing import PhaseTimer

log = logging.getLogger("app.runtime.encoders")
STAGE_PREFIX = "encoder."  # the encoder's phases: encoder.conv_in, ..., encoder.normalize


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

    @property
    def active(self) -> VAEEncoder:
        return self.reference if self.fallback else self.fast

    @property
    def serving_device(self) -> str:
        return "cpu" if self.fallback else self.device.type

    def describe(self) -> dict[str, Any]:
        return {
            "family": self.reference.family,
            "latent_channels": self.reference.latent_channels,
            "spatial_scale": self.reference.spatial_scale,
            "temporal_scale": self.reference.temporal_scale,
            "video": self.reference.is_video,
            "device": self.serving_device,
            "dtype": "float32",
            # "exact": the float32 CPU encoder itself; "optimized": the gated served copy
            "path": "exact" if self.active is self.reference else "optimized",
            "parity_cosine": self.cosine,
            "fallback": self.fallback,
            "fallback_reason": self.reason or None,
            "load_seconds": round(self.load_seconds, 3),
        }


def load_encoders(
    store: Path, names: list[str], device: torch.device, min_cos: float, verify: bool = False
) -> tuple[dict[str, ServedEncoder], dict[str, str]]:
    """The encoders of the served entries that hold one, and why any that should failed."""
    from app.store import read_manifest

    served: dict[str, ServedEncoder] = {}
    errors: dict[str, str] = {}
    for name in names:
        try:
            _, manifest = read_manifest(store, name)
            if "encoder" in manifest.parts:
                served[name] = load_one(store, name, device, min_cos, verify)
        except Exception as exc:  # the entry's decoder is still served
            errors[name] = str(exc)
            log.error("encoder of %s not served: %s", name, exc)
    return served, errors


def load_one(
    store: Path, name: str, device: torch.device, min_cos: float, verify: bool = False
) -> ServedEncoder:
    t0 = time.perf_counter()
    manifest, state = load_encoder(store, name, verify)
    module = encoder_module(manifest.family)
    reference = module.Encoder(manifest.encoder_config).eval()
    reference.load_state_dict(state)
    reference.float()
    reference.requires_grad_(False)
    _instrument(reference)
    fast = _served_copy(reference, device)
    cos = gate(reference, fast)
    passed = cos >= min_cos
    reason = "" if passed else f"encoder parity cosine {cos:.6f} < {min_cos} on {device.type}"
    if not passed:
        log.warning("encoder of %s served on the float32 CPU fallback: %s", name, reason)
    served = ServedEncoder(name, reference, fast, device, cos, not passed, reason)
    served.load_seconds = time.perf_counter() - t0
    log.info(
        "encoder of %s: %s, parity cosine %.7f, %.2f s",
        name,
        served.describe()["path"],
        cos,
        served.load_seconds,
    )
    return served


def _served_copy(reference: VAEEncoder, device: torch.device) -> VAEEncoder:
    """The copy requests run on: the reference itself where the family has no rewrites and
    the device is the CPU (nothing to gate), else a float32 copy on ``device``, optimized."""
    rewrites = type(reference).optimize is not VAEEncoder.optimize
    if device.type == "cpu" and not rewrites:
        return reference
    fast = copy.deepcopy(reference).to(device)
    fast.optimize()
    _instrument(fast)
    return fast


def _instrument(encoder: VAEEncoder) -> None:
    timing.instrument([(STAGE_PREFIX + name, module) for name, module in encoder.stages()])


@torch.inference_mode()
def gate(reference: VAEEncoder, fast: VAEEncoder) -> float:
    """Cosine of the served copy's moments against the exact encoder's on the probe input."""
    if fast is reference:
        return 1.0
    probe = reference.probe_input(torch.Generator().manual_seed(PROBE_SEED))
    expected = reference.moments(probe)
    got = fast.moments(probe.to(next(fast.parameters()).device))
    return cosine(got.float().cpu(), expected)


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
            pixels = request.pixels.to(device)
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
