"""The served encoder's mode, chosen by measurement (``app/runtime/encoders.select``): every
candidate encodes the probe, the fastest whose moments pass the gate is served, a candidate
that fails the gate never is, and the exact encoder serves until the measurement is done."""

from __future__ import annotations

import time

import pytest
import torch

from app.families.ops import cosine
from app.encoders import encoder_module
from app.runtime import encoders, modes

CPU = torch.device("cpu")
TAESD = encoder_module("taesd")


class SlowIn(TAESD.Encoder):
    """TAESD's encoder, slowed by a sleep when its weights are of one dtype: which mode wins
    must follow the measured time, whatever the CPU's flags say."""

    slow: torch.dtype = torch.float32

    def moments(self, x, **options):
        if next(self.parameters()).dtype == self.slow:
            time.sleep(0.3)  # far above any load spike of a 64x64 encode
        return super().moments(x, **options)


def _served(cls=TAESD.Encoder) -> encoders.ServedEncoder:
    config = next(iter(TAESD.SYNTHETIC.values()))
    reference = cls(config).eval()
    TAESD.init_synthetic(reference, torch.Generator().manual_seed(0))
    reference.requires_grad_(False)
    return encoders.ServedEncoder("taesd", reference, reference, CPU, 1.0, False)


@pytest.mark.parametrize("slow", [torch.float32, torch.bfloat16])
def test_the_measured_fastest_mode_is_served(slow):
    served = _served(type("Slow", (SlowIn,), {"slow": slow}))
    encoders.select(served, encoders.Policy("auto", min_cos=0.999, repeats=2))
    assert served.selection == "done" and not served.fallback
    assert served.mode.dtype != slow  # the slept-in dtype lost, in either order
    timed = {c.mode: c.probe_seconds for c in served.candidates}
    assert timed[served.mode] == min(timed.values())
    described = served.describe()
    assert described["dtype"] == str(served.mode.dtype).removeprefix("torch.")
    assert described["chosen_because"].startswith("fastest on the probe")
    assert {c["mode"] for c in described["candidates"]} == {str(m) for m in timed}


@torch.inference_mode()
def test_a_bf16_copy_serves_at_parity_and_takes_float32_pixels():
    served = _served()
    encoders.select(served, encoders.Policy("bfloat16", min_cos=0.9999, repeats=1))
    assert served.mode == modes.Mode(torch.bfloat16) and not served.fallback
    assert next(served.active.parameters()).dtype == torch.bfloat16
    assert next(served.reference.parameters()).dtype == torch.float32  # the reference is kept
    x = torch.rand(1, 3, 64, 96, generator=torch.Generator().manual_seed(3)) * 2 - 1
    request = _request(x)
    got = encoders.run_encode(served, request, _timer())
    assert got.dtype == torch.float32
    assert cosine(got, served.reference.encode(x)) >= 0.9999


class WrongInBatches(TAESD.Encoder):
    """TAESD whose bf16 copy is off on every batch row but the first: only the gate's batch
    of 2 can see it (a micro-batched request would get it)."""

    def moments(self, x, **options):
        out = super().moments(x, **options)
        if next(self.parameters()).dtype == torch.bfloat16 and out.shape[0] > 1:
            out = out.clone()
            out[1:] += 0.5
        return out


def test_a_copy_wrong_only_in_a_batch_fails_the_gate():
    served = _served(WrongInBatches)
    encoders.select(served, encoders.Policy("auto", min_cos=0.9999, repeats=1))
    assert served.mode.dtype == torch.float32, served.describe()
    bf16 = next(c for c in served.candidates if c.mode.dtype == torch.bfloat16)
    assert bf16.cosine < 0.99


def test_a_candidate_below_the_gate_is_not_served():
    served = _served()
    encoders.select(served, encoders.Policy("bfloat16", min_cos=0.9999999, repeats=1))
    assert served.fallback and served.active is served.reference
    assert "0.9999999" in served.reason and served.describe()["path"] == "exact"
    assert served.describe()["dtype"] == "float32"


def _store(folder):
    from app.families import family_module
    from app.store import write_model

    config = next(iter(TAESD.SYNTHETIC.values()))
    encoder = _served().reference
    decoder = family_module("taesd").Decoder(config)
    write_model(
        folder, "t", "taesd", config, decoder.state_dict(), "test",
        encoder_state=encoder.state_dict(),
    )  # fmt: skip
    return folder


def test_the_exact_encoder_serves_until_selected_after_ready(tmp_path):
    policy = encoders.Policy("auto", min_cos=0.999, repeats=1, after_ready=True)
    loaded = encoders.load_one(_store(tmp_path), "t", CPU, policy)
    assert loaded.selection == "pending" and loaded.active is loaded.reference
    assert loaded.describe()["mode"] == "float32 exact"
    encoders.select(loaded, policy)
    assert loaded.selection == "done" and len(loaded.candidates) >= 2


def test_the_runtime_measures_its_encoders_after_ready(tmp_path):
    from app.config import Settings
    from app.runtime import Runtime
    from app.telemetry.metrics import Metrics

    settings = Settings(models_dir=_store(tmp_path), models="t", select="after_ready")
    runtime = Runtime(settings, Metrics())
    runtime.load_all()
    served = runtime.encoders["t"]
    assert served.selection == "done" and {str(c.mode) for c in served.candidates} >= {
        "float32 exact"
    }
    assert served.describe()["chosen_because"]


def _request(x):
    from app.protocol.request import EncodeRequest

    return EncodeRequest(pixels=x)


def _timer():
    from app.telemetry.timing import PhaseTimer

    return PhaseTimer()
