"""The parity gate: the fast copy is served only if it decodes like the float32 CPU path.

At startup both decode fixed, seeded N(0,1) probes through every way a request can be served:
batch 1 as sent, a batch of 2 whose second latent goes through the model's de-normalization,
and the tiled (banded) decode where the family has one, on a probe larger than one tile. With
``VAE_GATE_FULL`` (auto: on a GPU) a ``full`` check decodes a latent of the family's native
resolution (``full_latent``) and compares it with a float32 exact copy's output on the same
device, where the device can hold that decode (else the check is skipped and says why). Each
check reports the cosine of the two outputs (flattened, float64) and the PSNR of their uint8
images; the gate passes when the lowest untiled cosine reaches ``VAE_PARITY_MIN_COS``, and a
tiled decode runs on the gated copy only if the tiled check reached it too (else on the exact
path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from app.decoders.base import VAEDecoder
from app.decoders.ops import cosine
from app.runtime import device as devices
from app.runtime import modes

PROBE_SEED = 20261130


@dataclass
class Check:
    name: str
    cosine: float
    psnr_db: float


@dataclass
class GateReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def cosine(self) -> float:
        return min((c.cosine for c in self.checks), default=1.0)

    @property
    def psnr_db(self) -> float:
        return min((c.psnr_db for c in self.checks), default=math.inf)

    def passed(self, min_cos: float) -> bool:
        """The untiled checks (a copy whose tiled decode fails serves untiled decodes only)."""
        return min((c.cosine for c in self.checks if c.name != "tiled"), default=1.0) >= min_cos

    def tiled_passed(self, min_cos: float) -> bool:
        """The tiled check passed (or there is none: the family does not tile)."""
        return all(c.cosine >= min_cos for c in self.checks if c.name == "tiled")

    def describe(self) -> dict[str, dict[str, float]]:
        return {c.name: {"cosine": c.cosine, "psnr_db": _finite(c.psnr_db)} for c in self.checks}


EXACT_REPORT = GateReport([Check("exact", 1.0, math.inf)])


class Probes:
    """The probe latents and the reference's outputs for them (the same expected outputs gate
    every candidate mode): stored with the model (app/runtime/references.py), else computed."""

    def __init__(
        self, reference: VAEDecoder, full_on: torch.device | None = None, memory_cap: int = 0
    ) -> None:
        self.reference = reference
        gen = torch.Generator().manual_seed(PROBE_SEED)
        self.plain = reference.probe_latent(gen)
        self.second = reference.probe_latent(gen)
        # larger than one tile of the decode's own tile geometry (tests/test_probe_latent.py)
        self.tiled = (
            reference.probe_latent(torch.Generator().manual_seed(PROBE_SEED + 1), tiled=True)
            if reference.supports_tiling
            else None
        )
        self._expected: dict[str, Tensor] = {}
        # the full-resolution check: computed on the serving device at the gate, never stored
        self.full_on, self.memory_cap = full_on, memory_cap
        self.full = None
        if full_on is not None:
            self.full = reference.full_latent(torch.Generator().manual_seed(PROBE_SEED + 2))
        self.full_skipped = ""  # why the full-resolution check did not run
        self._full_expected: Tensor | None = None

    def check_names(self) -> list[str]:
        """The stored reference outputs the gate compares with (``full`` is made on the
        serving device)."""
        return ["plain", "denormalized"] + (["tiled"] if self.tiled is not None else [])

    def spec(self) -> dict:
        """What the probes are (a part of the stored reference's key)."""
        shapes = {"plain": self.plain, "second": self.second, "tiled": self.tiled}
        return {
            "seed": PROBE_SEED,
            "shapes": {k: list(v.shape) for k, v in shapes.items() if v is not None},
        }

    def set_expected(self, tensors: dict[str, Tensor]) -> None:
        self._expected = dict(tensors)

    def all_expected(self) -> dict[str, Tensor]:
        return {name: self.expected(name) for name in self.check_names()}

    def expected(self, name: str) -> Tensor:
        if name not in self._expected:
            z, options = self.inputs(name, self.reference)
            if name == "tiled" and self.reference.exact_tiling:
                options = {"tiled": False}  # the same function: checked against the untiled
            with torch.inference_mode():
                self._expected[name] = self.reference.decode(z, **options)
        return self._expected[name]

    def expected_full(self) -> Tensor | None:
        """A float32 exact copy's decode of ``full`` on the serving device (made once, the
        copy freed after), or None where the device cannot hold that decode."""
        if self._full_expected is not None or self.full is None or self.full_skipped:
            return self._full_expected
        device, reference = self.full_on, self.reference
        weights = sum(p.numel() * 4 for p in reference.parameters())
        needed = weights + reference.working_bytes(tuple(self.full.shape), 4)
        budget = devices.memory_budget(device, self.memory_cap)
        if budget is not None and needed > budget:
            self.full_skipped = f"needs {needed / 2**30:.1f} GiB, {budget / 2**30:.1f} GiB free"
            return None
        exact = modes.build(reference, device, modes.Mode(torch.float32, optimized=False))
        z, options = self.full.to(device), _untiled(reference)
        try:
            with torch.inference_mode():
                self._full_expected = exact.decode(z, **options).float().cpu()
        except Exception as exc:
            if not devices.is_oom(exc):
                raise
            self.full_skipped = f"out of memory on {device.type}"
        finally:
            del exact
            devices.release_cached(device)
        return self._full_expected

    def inputs(self, name: str, decoder: VAEDecoder) -> tuple[Tensor, dict]:
        """(latent, options) of one check, for the reference (single) or the fast copy."""
        if name == "denormalized":
            return decoder.denormalize(self.second.float()), {}
        if name == "tiled":
            return self.tiled, {"tiled": True}
        return self.plain, _untiled(decoder)


def _untiled(decoder: VAEDecoder) -> dict:
    return {"tiled": False} if decoder.supports_tiling else {}


@torch.inference_mode()
def decode_plain(fast: VAEDecoder, probes: Probes) -> Tensor:
    """The batch-1 check's decode (the one the mode selection times)."""
    z, options = probes.inputs("plain", fast)
    return fast.decode(z.to(_device(fast)), **options)


def check_plain(fast: VAEDecoder, probes: Probes, single: Tensor) -> Check:
    return _check("batch1", fast, single, probes.expected("plain"))


@torch.inference_mode()
def run(fast: VAEDecoder, probes: Probes, single: Tensor | None = None) -> GateReport:
    """Decode every probe on ``fast`` and compare with the reference's outputs. ``single``:
    the batch-1 decode of the plain probe when it was already made (timing the mode)."""
    if fast is probes.reference:
        return EXACT_REPORT
    device = _device(fast)
    report = GateReport()
    if single is None:
        single = decode_plain(fast, probes)
    report.checks.append(check_plain(fast, probes, single))
    # batch 2: the plain probe and a de-normalized one, decoded together as a micro-batch is
    plain = probes.plain.to(device)
    denorm = fast.denormalize(probes.second.to(device).float())
    options = {"tiled": False} if fast.supports_tiling else {}
    batch = fast.decode(torch.cat([plain, denorm]), **options)
    report.checks.append(_check("batch2", fast, batch[:1], probes.expected("plain")))
    report.checks.append(_check("denormalized", fast, batch[1:], probes.expected("denormalized")))
    if probes.tiled is not None:
        got = fast.decode(probes.tiled.to(device), tiled=True)
        report.checks.append(_check("tiled", fast, got, probes.expected("tiled")))
    expected = probes.expected_full()
    if expected is not None:
        got = fast.decode(probes.full.to(device), **_untiled(fast))
        report.checks.append(_check("full", fast, got, expected))
    return report


def _device(decoder: VAEDecoder) -> torch.device:
    return next(decoder.parameters()).device


def _check(name: str, decoder: VAEDecoder, got: Tensor, expected: Tensor) -> Check:
    got, expected = got.float().cpu(), expected.float()
    return Check(name, cosine(got, expected), psnr_db(decoder, got, expected))


def psnr_db(decoder: VAEDecoder, got: Tensor, expected: Tensor) -> float:
    """PSNR of the two outputs as the uint8 images a client would receive."""
    a = (decoder.to_unit(got) * 255).round()
    b = (decoder.to_unit(expected) * 255).round()
    mse = float((a - b).double().pow(2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
