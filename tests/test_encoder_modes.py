"""The served encoder's mode, chosen by measurement as a decoder's is (``app/runtime/selection
.choose`` with the encoder's gate probes, ``gate.probes_for``): every candidate encodes the
probe, the fastest whose moments pass the gate is served, a candidate that fails the gate
never is, and the exact encoder serves until the measurement is done (``Runtime``)."""

from __future__ import annotations

import time

import pytest
import torch

from app.families import family, keys
from app.families.ops import CHANNELS_LAST, cosine
from app.families.taesd.encoder import SYNTHETIC
from app.runtime import gate, modes, selection

CPU = torch.device("cpu")
TAESD = family("taesd").encoder
CONFIG = next(iter(SYNTHETIC.values()))
SLEEP_S = 1.5


class SlowIn(TAESD.module):
    """TAESD's encoder, slowed by a sleep when its weights are of one dtype: which mode wins
    must follow the measured time, whatever the CPU's flags say. Its probe is small (16x16),
    so that the sleep is far above any load spike of the encode itself."""

    slow: torch.dtype = torch.float32

    def probe_input(self, generator: torch.Generator) -> torch.Tensor:
        return torch.rand((1, 3, 16, 16), generator=generator) * 2 - 1

    def moments(self, x, **options):
        if next(self.parameters()).dtype == self.slow:
            time.sleep(SLEEP_S)
        return super().moments(x, **options)


def _reference(cls=TAESD.module):
    reference = cls(CONFIG).eval()
    TAESD.init_synthetic(reference, torch.Generator().manual_seed(0))
    return reference.requires_grad_(False)


def _choose(reference, setting: str, min_cos: float, repeats: int) -> selection.Selection:
    """The unified selection, on the encoder's own probes (``EncoderProbes``)."""
    probes = gate.probes_for(reference)
    assert isinstance(probes, gate.EncoderProbes)
    candidates = modes.candidate_modes(setting, CPU)
    return selection.choose("encoder of t", probes, CPU, candidates, min_cos, repeats)


@pytest.mark.bf16_order  # auto: the order is read
@pytest.mark.parametrize("slow", [torch.float32, torch.bfloat16])
def test_the_measured_fastest_mode_is_served(slow, monkeypatch):
    # on a loaded machine a first encode can take a second: every mode its repeats (no early
    # stop on one unlucky first run), the best of 3 kept; bf16 measured even where the CPU
    # emulates it (the 16x16 probe takes milliseconds there too)
    monkeypatch.setattr(selection, "CLEARLY_SLOWER", float("inf"))
    monkeypatch.setattr(modes, "cpu_offers_bf16", lambda: True)
    chosen = _choose(_reference(type("Slow", (SlowIn,), {"slow": slow})), "auto", 0.999, 3)
    assert chosen.passed
    assert chosen.chosen.mode.dtype != slow  # the slept-in dtype lost, in either order
    timed = {c.mode: c.probe_seconds for c in chosen.candidates}
    assert len(timed) == 4 and all(t is not None for t in timed.values()), chosen.candidates
    # the fastest, or one within the tie margin of it that comes earlier in the order
    assert timed[chosen.chosen.mode] <= min(timed.values()) * selection.TIE
    assert all(timed[c.mode] >= SLEEP_S for c in chosen.candidates if c.mode.dtype == slow)
    assert chosen.why.startswith(("fastest on the probe", "within"))
    described = [c.describe(0.999) for c in chosen.candidates]
    assert {c["mode"] for c in described} == {str(m) for m in timed}
    served = next(c for c in described if c["mode"] == str(chosen.chosen.mode))
    assert served["gated"] and served["passed"]


def test_the_encoders_gate_checks_the_probe_alone_and_in_a_batch_of_2():
    reference = _reference()
    fast = modes.build(reference, CPU, modes.Mode(torch.bfloat16))
    report = gate.run(fast, gate.probes_for(reference))
    assert {c.name for c in report.checks} == {"batch1", "batch2", "second"}
    assert report.passed(0.9999) and report.cosine < 1.0, report.describe()


class WrongInBatches(TAESD.module):
    """TAESD whose bf16 copy is off on every batch row but the first: only the gate's batch
    of 2 can see it (a micro-batched request would get it)."""

    def moments(self, x, **options):
        out = super().moments(x, **options)
        if next(self.parameters()).dtype == torch.bfloat16 and out.shape[0] > 1:
            out = out.clone()
            out[1:] += 0.5
        return out


@pytest.mark.bf16_order  # auto: the order is read
def test_a_copy_wrong_only_in_a_batch_fails_the_gate():
    reference = _reference(WrongInBatches)
    chosen = _choose(reference, "auto", 0.9999, 1)
    assert chosen.passed and chosen.chosen.mode.dtype == torch.float32, chosen.candidates
    for c in chosen.candidates:
        if c.mode.dtype == torch.bfloat16:  # gated or not (ranked after the winner), never passed
            assert not c.passed(0.9999)
    # bf16 alone: its batch-1 probe passes, the gate's batch of 2 does not
    only = _choose(reference, "bfloat16", 0.9999, 1)
    assert not only.passed and only.chosen.mode.dtype == torch.bfloat16
    checks = {c.name: c.cosine for c in only.chosen.report.checks}
    assert checks["batch1"] >= 0.9999 and checks["second"] < 0.99, checks


def test_a_candidate_below_the_gate_is_not_chosen():
    chosen = _choose(_reference(), "bfloat16", 0.9999999, 1)
    assert not chosen.passed and chosen.why == "no candidate passes the gate"
    assert chosen.chosen.report is not None and chosen.chosen.report.cosine < 0.9999999


# --- the served encoder, through the runtime ---------------------------------------------------
def _store(folder):
    from app.store import write_model

    encoder = _reference()
    decoder = family("taesd").decoder.module(CONFIG)
    write_model(
        folder, "t", "taesd", CONFIG, decoder.state_dict(), "test",
        encoder_state=encoder.state_dict(),
    )  # fmt: skip
    return folder


def _runtime(folder, **settings):
    from app.config import Settings
    from app.runtime import Runtime
    from app.telemetry.metrics import Metrics

    return Runtime(Settings(models_dir=_store(folder), models="t", **settings), Metrics())


def _encode(runtime, served, x: torch.Tensor) -> torch.Tensor:
    from app.protocol.request import EncodeRequest
    from app.telemetry.timing import PhaseTimer

    return torch.cat(runtime.runner.rows(served, EncodeRequest(pixels=x), PhaseTimer()))


@torch.inference_mode()
def test_a_bf16_copy_serves_at_parity_and_takes_float32_pixels(tmp_path):
    runtime = _runtime(tmp_path, dtype="bfloat16")
    runtime.load_all()
    served = runtime.encoders["t"]
    assert served.part == "encoder"
    assert served.mode == modes.Mode(torch.bfloat16) and not served.fallback
    assert next(served.active.parameters()).dtype == torch.bfloat16
    assert served.active.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert next(served.reference.parameters()).dtype == torch.float32  # the reference is kept
    assert {c.name for c in served.gate.checks} == {"batch1", "batch2", "second"}
    x = torch.rand(1, 3, 64, 96, generator=torch.Generator().manual_seed(3)) * 2 - 1
    got = _encode(runtime, served, x)
    assert got.dtype == torch.float32
    assert cosine(got, served.reference.encode(x)) >= 0.9999
    described = served.describe()
    assert described["dtype"] == "bfloat16" and described["path"] == "optimized"


def test_a_served_encoder_below_the_gate_falls_back_to_the_exact_path(tmp_path):
    runtime = _runtime(tmp_path, dtype="bfloat16", parity_min_cos=0.9999999)
    runtime.load_all()
    served = runtime.encoders["t"]
    assert served.fallback and served.active is served.reference
    assert "0.9999999" in served.reason and served.describe()["path"] == "exact"
    assert served.describe()["dtype"] == "float32"


@pytest.mark.bf16_order  # auto: the order is read
def test_the_exact_encoder_serves_until_selected_after_ready(tmp_path):
    runtime = _runtime(tmp_path, dtype="auto", select="after_ready", gate_repeats=1)
    runtime.registry.load_all()  # ready: the modes not measured yet
    loaded = runtime.encoders["t"]
    assert loaded.describe()["selection"] == "pending" and loaded.active is loaded.reference
    assert loaded.describe()["mode"] == "float32 exact"
    runtime.registry.select_pending()
    selected = runtime.encoders["t"]
    assert selected.describe()["selection"] == "done" and len(selected.candidates) >= 2
    assert not selected.fallback


@pytest.mark.bf16_order  # auto: the order is read
def test_the_runtime_measures_its_encoders_after_ready(tmp_path):
    runtime = _runtime(tmp_path, select="after_ready")
    runtime.load_all()
    served = runtime.encoders["t"]
    assert served.describe()["selection"] == "done"
    assert {c["mode"] for c in served.candidates} >= {"float32 exact"}
    assert served.describe()["chosen_because"]


def _seeded_encoder(key: str) -> torch.nn.Module:
    """The family's first embedded encoder config, seeded."""
    described = family(key)
    config = next(r.encoder_config for r in described.synthetic.values() if r.encoder_config)
    encoder = described.encoder.module(config)
    described.encoder.init_synthetic(encoder, torch.Generator().manual_seed(0))
    return encoder.eval()


@pytest.mark.parametrize("key", [k for k in keys() if family(k).encoder])
@torch.inference_mode()
def test_a_served_float32_copy_is_laid_out_as_the_family_says_and_at_parity(key):
    """``channels_last`` (the class flag) lays a served CPU copy's conv weights channels-last,
    2-D and 3-D alike (``modes.set_channels_last``); the exact encoder stays as stored."""
    reference = _seeded_encoder(key)
    served = modes.build(reference, CPU, modes.Mode(torch.float32))  # float32, optimized
    convs = [p for p in served.parameters() if p.ndim in CHANNELS_LAST and p.shape[1] > 1]
    assert convs, key
    laid_out = [p.is_contiguous(memory_format=CHANNELS_LAST[p.ndim]) for p in convs]
    assert all(laid_out) if reference.channels_last else not any(laid_out), key
    assert all(p.is_contiguous() for p in reference.parameters()), key  # the exact one: as stored
    x = gate.probes_for(reference).plain
    assert cosine(served.moments(x), reference.moments(x)) >= 0.99999, key


def test_a_selection_after_ready_ends_between_two_runs_once_the_service_stops():
    """SIGTERM during the after-ready measurement: it ends before the next timed run (it
    ended after the whole part, which could keep an idle process to its drain deadline)."""
    probes = gate.probes_for(_reference())
    candidates = [modes.EXACT, modes.Mode(torch.float32)]
    asked: list[int] = []

    def stop() -> bool:  # SIGTERM arrives during the first candidate's run
        asked.append(1)
        return len(asked) > 1

    with pytest.raises(selection.Interrupted, match="shutting down"):
        selection.choose("encoder of t", probes, CPU, candidates, 0.9999, 2, stop=stop)
    assert len(asked) == 2  # asked before the first run and the second: nothing ran after
