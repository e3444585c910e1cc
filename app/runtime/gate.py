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

An encoder is gated the same way (``EncoderProbes``): its copy's moments of a seeded probe
image, alone and in a batch of 2 with a second one, against the exact encoder's.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from app.families.decoder import VAEDecoder
from app.families.encoder import VAEEncoder
from app.families.ops import cosine
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


class Probes(ABC):
    """A part's probe inputs and the exact path's outputs for them (the same expected outputs
    gate every candidate mode): stored with the model (app/runtime/references.py), else
    computed. ``run_plain`` is the batch-1 check's run, the one the mode selection times."""

    reference: nn.Module
    tiled: Tensor | None = None  # the tiled check's input, where the part tiles

    def __init__(self) -> None:
        self._expected: dict[str, Tensor] = {}

    @abstractmethod
    def check_names(self) -> list[str]:
        """The stored outputs the gate compares with."""

    @abstractmethod
    def spec(self) -> dict:
        """What the probes are (a part of the stored reference's key)."""

    @abstractmethod
    def expected(self, name: str) -> Tensor:
        """The exact path's output for one check (computed once)."""

    @abstractmethod
    def run_plain(self, fast: nn.Module) -> Tensor:
        """The batch-1 check's output on ``fast``."""

    @abstractmethod
    def checks(self, fast: nn.Module, single: Tensor) -> list[Check]:
        """Every check of ``fast``, its batch-1 output given."""

    def set_expected(self, tensors: dict[str, Tensor]) -> None:
        self._expected = dict(tensors)

    def all_expected(self) -> dict[str, Tensor]:
        return {name: self.expected(name) for name in self.check_names()}

    def check_plain(self, fast: nn.Module, single: Tensor) -> Check:
        return _check("batch1", single, self.expected("plain"), self._psnr)

    def _psnr(self, got: Tensor, expected: Tensor) -> float:
        return math.inf


class DecoderProbes(Probes):
    """A decoder's probe latents: batch 1, a batch of 2 with a de-normalized latent, the tiled
    decode where the family tiles, and the full-resolution check where it is on."""

    def __init__(
        self, reference: VAEDecoder, full_on: torch.device | None = None, memory_cap: int = 0
    ) -> None:
        super().__init__()
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
        if needed > budget:
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

    @torch.inference_mode()
    def run_plain(self, fast: nn.Module) -> Tensor:
        z, options = self.inputs("plain", fast)
        return fast.decode(z.to(_device(fast)), **options)

    @torch.inference_mode()
    def checks(self, fast: nn.Module, single: Tensor) -> list[Check]:
        device, psnr = _device(fast), self._psnr
        checks = [self.check_plain(fast, single)]
        # batch 2: the plain probe and a de-normalized one, decoded together as a micro-batch is
        plain = self.plain.to(device)
        denorm = fast.denormalize(self.second.to(device).float())
        batch = fast.decode(torch.cat([plain, denorm]), **_untiled(fast))
        checks.append(_check("batch2", batch[:1], self.expected("plain"), psnr))
        checks.append(_check("denormalized", batch[1:], self.expected("denormalized"), psnr))
        if self.tiled is not None:
            got = fast.decode(self.tiled.to(device), tiled=True)
            checks.append(_check("tiled", got, self.expected("tiled"), psnr))
        expected = self.expected_full()
        if expected is not None:
            got = fast.decode(self.full.to(device), **_untiled(fast))
            checks.append(_check("full", got, expected, psnr))
        return checks

    def _psnr(self, got: Tensor, expected: Tensor) -> float:
        return psnr_db(self.reference, got, expected)


def _untiled(decoder: VAEDecoder) -> dict:
    return {"tiled": False} if decoder.supports_tiling else {}


class EncoderProbes(Probes):
    """An encoder's probe images: the family's seeded ``probe_input`` alone, and in a batch of
    2 with a second one (as a micro-batch runs); the moments compared, mean and logvar."""

    def __init__(self, reference: VAEEncoder) -> None:
        super().__init__()
        self.reference = reference
        gen = torch.Generator().manual_seed(PROBE_SEED)
        self.plain = reference.probe_input(gen)
        self.second = reference.probe_input(gen)

    def check_names(self) -> list[str]:
        return ["plain", "second"]

    def spec(self) -> dict:
        return {
            "seed": PROBE_SEED,
            "shapes": {"plain": list(self.plain.shape), "second": list(self.second.shape)},
        }

    def expected(self, name: str) -> Tensor:
        if name not in self._expected:
            with torch.inference_mode():
                self._expected[name] = self.reference.moments(getattr(self, name))
        return self._expected[name]

    @torch.inference_mode()
    def run_plain(self, fast: nn.Module) -> Tensor:
        return served_moments(fast, _on(self.plain, fast))

    @torch.inference_mode()
    def checks(self, fast: nn.Module, single: Tensor) -> list[Check]:
        batch = served_moments(fast, _on(torch.cat([self.plain, self.second]), fast))
        return [
            self.check_plain(fast, single),
            _check("batch2", batch[:1], self.expected("plain"), self._psnr),
            _check("second", batch[1:], self.expected("second"), self._psnr),
        ]


def served_moments(encoder: VAEEncoder, x: Tensor) -> Tensor:
    """The moments as the runtime serves them: ``iter_moments``'s chunks (a video encoder's
    schedule, window by window), put together."""
    chunks = list(encoder.iter_moments(x))
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, 2)


def probes_for(
    reference: nn.Module, full_on: torch.device | None = None, memory_cap: int = 0
) -> Probes:
    """The probes that gate copies of ``reference`` (a decoder's or an encoder's)."""
    if isinstance(reference, VAEEncoder):
        return EncoderProbes(reference)
    return DecoderProbes(reference, full_on, memory_cap)


@torch.inference_mode()
def run(fast: nn.Module, probes: Probes, single: Tensor | None = None) -> GateReport:
    """Run every probe on ``fast`` and compare with the exact path's outputs. ``single``: the
    batch-1 output of the plain probe when it was already made (timing the mode)."""
    if fast is probes.reference:
        return EXACT_REPORT
    if single is None:
        single = probes.run_plain(fast)
    return GateReport(probes.checks(fast, single))


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _on(x: Tensor, module: nn.Module) -> Tensor:
    """``x`` on the module's device, in its parameters' dtype (how a request's pixels go up)."""
    first = next(module.parameters())
    return x.to(first.device, first.dtype)


def _check(
    name: str, got: Tensor, expected: Tensor, psnr: Callable[[Tensor, Tensor], float]
) -> Check:
    got, expected = got.float().cpu(), expected.float()
    return Check(name, cosine(got, expected), psnr(got, expected))


def psnr_db(decoder: VAEDecoder, got: Tensor, expected: Tensor) -> float:
    """PSNR of the two outputs as the uint8 images a client would receive."""
    a = (decoder.to_unit(got) * 255).round()
    b = (decoder.to_unit(expected) * 255).round()
    mse = float((a - b).double().pow(2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
