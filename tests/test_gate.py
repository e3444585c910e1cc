"""The parity gate and the float32 CPU fallback, exercised on the CPU.

Each test asserts what the runtime promises for the mode it actually chose (read back from
the served model), so it holds on CPUs with and without native bf16."""

from __future__ import annotations

import math

import pytest
import requests
import torch

from app.config import Settings
from app.families import family
from app.families.taesd import decoder as taesd
from app.families.taesd.decoder.synthetic import TINY as TAESD_TINY
from app.protocol.request import DecodeRequest, Output
from app.runtime import Runtime, gate, modes
from app.store import load_model
from app.telemetry.metrics import Metrics
from app.telemetry.timing import PhaseTimer
from tests.float32_twin import Float32Twin
from tests.live import live_server


def _runtime(store, **settings) -> Runtime:
    runtime = Runtime(Settings(models_dir=store, models="flux-tiny", **settings), Metrics())
    runtime.load_all()
    return runtime


def _decode(runtime: Runtime, model, z, output=Output.TENSOR):
    return runtime.runner.decode(model, DecodeRequest(z, output), PhaseTimer())


def test_bf16_fast_path_passes_every_gate_check_and_stays_close(flux_store):
    runtime = _runtime(flux_store, dtype="bfloat16")
    model = runtime.models["flux-tiny"]
    assert not model.fallback and model.mode.dtype == torch.bfloat16
    # every served way is gated: batch 1, a batch of 2 with a de-normalized row, tiled
    assert {c.name for c in model.gate.checks} == {"batch1", "batch2", "denormalized", "tiled"}
    assert 0.9999 <= model.parity_cosine < 1.0  # a real comparison, not a copy of itself
    assert 30 < model.gate.psnr_db < math.inf
    assert next(model.fast.parameters()).dtype == torch.bfloat16
    z = torch.randn(1, 16, 8, 8)
    fast = _decode(runtime, model, z)
    exact = model.reference.decode(z)
    cos = torch.nn.functional.cosine_similarity(
        fast.flatten().double(), exact.flatten().double(), 0
    )
    assert cos >= 0.9999 and fast.dtype == torch.float32


def test_unreachable_threshold_falls_back_to_float32_cpu(flux_store):
    runtime = _runtime(flux_store, dtype="bfloat16", parity_min_cos=1.01)
    model = runtime.models["flux-tiny"]
    assert model.fallback and "parity cosine" in model.reason
    assert model.active is model.reference
    text = runtime.metrics.exposition().decode()
    assert 'vae_fallback_active{model="flux-tiny"} 1.0' in text
    z = torch.randn(1, 16, 8, 8)
    out = _decode(runtime, model, z)
    _, fresh = load_model(flux_store, "flux-tiny")
    assert torch.equal(out, fresh.decode(z))  # the exact path, bit for bit
    assert runtime.ready


def test_fallback_off_keeps_readyz_503_and_still_exports_the_cosine(flux_store):
    settings = dict(dtype="bfloat16", parity_min_cos=1.01, fallback="off", models="flux-tiny")
    with live_server(flux_store, **settings) as url:
        ready = requests.get(f"{url}/readyz")
        assert ready.status_code == 503
        assert "parity cosine" in ready.json()["reason"] and "flux-tiny" in ready.json()["reason"]
        models = requests.get(f"{url}/models").json()
        assert "flux-tiny" in models["errors"]
        metrics = requests.get(f"{url}/metrics").text
        line = next(x for x in metrics.splitlines() if x.startswith("vae_parity_cosine{"))
        assert 0.99 < float(line.split()[-1]) < 1.0
        # never served: no load time (VaeNoReadyReplica fires on a replica with none)
        assert "vae_model_load_seconds{" not in metrics


def test_fallback_cpu_is_reported_in_models(flux_store):
    with live_server(flux_store, dtype="bfloat16", parity_min_cos=1.01, models="flux-tiny") as url:
        assert requests.get(f"{url}/readyz").status_code == 200
        (model,) = requests.get(f"{url}/models").json()["models"]
        assert model["fallback"] is True and model["device"] == "cpu"
        assert model["dtype"] == "float32" and "parity cosine" in model["fallback_reason"]
        assert model["path"] == "exact"


@pytest.mark.bf16_order
def test_auto_serves_a_gated_mode_measured_fastest(flux_store):
    """auto: whichever candidate mode this CPU decoded the probe fastest with, gated."""
    runtime = _runtime(flux_store, dtype="auto", select="before_ready")
    model = runtime.models["flux-tiny"]
    assert not model.fallback and model.parity_cosine >= 0.9999
    if model.fast is not model.reference:  # an optimized copy: channels_last, its own tensors
        assert model.fast.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    z = torch.randn(1, 16, 9, 7)
    exact = model.reference.decode(z)
    # the promise for the chosen dtype: float32 is within rounding, bf16 within the gate
    tolerance = 1e-3 if model.mode.dtype == torch.float32 else 0.1
    for tiled in (False, True):  # banded and unbanded are both served, both gated
        request = DecodeRequest(z, Output.TENSOR, options={"tiled": tiled})
        out = runtime.runner.decode(model, request, PhaseTimer())
        assert (out - exact).abs().max() < tolerance
        cos = torch.nn.functional.cosine_similarity(
            out.flatten().double(), exact.flatten().double(), 0
        )
        assert cos >= 0.9999


def test_float32_is_the_exact_path(flux_store):
    runtime = _runtime(flux_store, dtype="float32")
    model = runtime.models["flux-tiny"]
    assert model.fast is model.reference and model.parity_cosine == 1.0


def test_fast_copy_keeps_latent_statistics_in_float32(tmp_path):
    """FLUX.2's BatchNorm statistics stay float32 on a bf16 copy: de-normalization keeps its
    precision."""
    from tests.live import TINY_FLUX, bake

    bake(tmp_path, "flux", "flux2-tiny", TINY_FLUX["flux2-tiny"])
    settings = Settings(models_dir=tmp_path, models="flux2-tiny", dtype="bfloat16")
    runtime = Runtime(settings, Metrics())
    runtime.load_all()
    model = runtime.models["flux2-tiny"]
    assert next(model.fast.parameters()).dtype == torch.bfloat16
    assert model.fast.bn.running_var.dtype == torch.float32
    z = torch.randn(1, 32, 8, 8)
    assert torch.equal(model.fast.denormalize(z), model.reference.denormalize(z))


@pytest.mark.parametrize(
    "key,name",
    [
        ("ltx", "ltx-tiny"),
        ("ltx", "ltx2-tiny"),
        ("hunyuan-video", "hunyuan-video-tiny"),
        ("minimax-h3", "minimax-h3-tiny"),
        ("minimax-h3", "minimax-h3-image-tiny"),
    ],
)
@pytest.mark.bf16_kernels
def test_every_family_builds_a_bf16_copy_that_passes_every_gate_check(key, name):
    """The bf16 copy is what a GPU serves: each family must build and gate it (the first GPU
    run found MiniMax-H3's float32 final norm fed bf16 weights)."""
    described = family(key)
    reference = described.decoder.module(described.synthetic[name].config)
    described.decoder.init_synthetic(reference, torch.Generator().manual_seed(0))
    reference.eval().requires_grad_(False)
    fast = modes.build(reference, torch.device("cpu"), modes.Mode(torch.bfloat16))
    report = gate.run(fast, gate.probes_for(reference))
    expected = {"batch1", "batch2", "denormalized"} | ({"tiled"} if fast.supports_tiling else set())
    assert {c.name for c in report.checks} == expected
    assert report.passed(0.9999) and report.cosine < 1.0, report.describe()


@pytest.mark.bf16_order(set_by_test=True)
@pytest.mark.parametrize("native_bf16", ["1", "0"])
def test_auto_orders_bf16_first_only_on_a_cpu_with_native_bf16(
    flux_store, monkeypatch, native_bf16
):
    """Both orders of ``auto``'s candidates on any CPU (read back from the app's own
    ``/models``); the served one is measured, never picked by the flags: no candidate that
    passed the gate decoded the probe clearly faster."""
    from fastapi.testclient import TestClient

    from app.http import create_app
    from app.runtime import selection
    from app.runtime.device import cpu_has_fast_bf16

    monkeypatch.setenv("VAE_CPU_FAST_BF16", native_bf16)
    assert cpu_has_fast_bf16() is (native_bf16 == "1")
    settings = Settings(models_dir=flux_store, models="flux-tiny", dtype="auto")
    with TestClient(create_app(settings, load_in_background=False)) as client:
        (described,) = client.get("/models").json()["models"]
    order = [c["mode"] for c in described["candidates"]]
    assert order[0] == ("bfloat16" if native_bf16 == "1" else "float32")
    assert set(order) == {"float32", "float32 exact", "bfloat16", "bfloat16 exact"}
    assert not described["fallback"] and 0.9999 <= described["parity_cosine"]
    served = next(c for c in described["candidates"] if c["mode"] == described["mode"])
    assert served["passed"] and described["chosen_because"]
    for c in described["candidates"]:
        if c["probe_seconds"] * selection.TIE < served["probe_seconds"]:
            assert not c["passed"], described["candidates"]


class _WrongWhenLarge(taesd.Decoder):
    """TAESD whose optimized copy is off by 0.25 on outputs above 256 px: a fast path that
    only the native-resolution check can catch (the gate's probes are 128 px)."""

    native_size = (384, 384)
    optimized = False

    def optimize(self) -> None:
        self.optimized = True

    def decode(self, z, **options):
        out = super().decode(z, **options)
        large = out.shape[-1] > 256
        return out + 0.25 if self.optimized and large else out


def _taesd(cls=None):
    part = family("taesd").decoder
    reference = (cls or part.module)(TAESD_TINY)
    part.init_synthetic(reference, torch.Generator().manual_seed(0))
    return reference.eval().requires_grad_(False)


class _Native384(Float32Twin, taesd.Decoder):
    """Small, and its bf16 copy computes with float32 twin weights (``tests.float32_twin``):
    the check's cost on any CPU, bf16 emulated included."""

    native_size = (384, 320)


def test_the_full_resolution_check_decodes_the_native_size_against_float32():
    reference = _taesd(_Native384)
    probes = gate.probes_for(reference, full_on=torch.device("cpu"))
    assert tuple(probes.full.shape) == (1, reference.latent_channels, 384 // 8, 320 // 8)
    fast = modes.build(reference, torch.device("cpu"), modes.Mode(torch.bfloat16))
    report = gate.run(fast, probes)
    full = next(c for c in report.checks if c.name == "full")
    assert 0.9999 <= full.cosine < 1.0 and report.passed(0.9999)
    assert "full" not in probes.check_names()  # made on the device, never stored


def test_a_fast_path_wrong_only_at_full_resolution_fails_the_gate():
    reference = _taesd(_WrongWhenLarge)
    fast = modes.build(reference, torch.device("cpu"), modes.Mode(torch.float32))
    assert gate.run(fast, gate.probes_for(reference)).passed(0.9999)  # the probes miss it
    report = gate.run(fast, gate.probes_for(reference, full_on=torch.device("cpu")))
    assert not report.passed(0.9999)
    assert min(report.checks, key=lambda c: c.cosine).name == "full"


def test_the_full_resolution_check_is_skipped_where_the_device_cannot_hold_it(monkeypatch):
    monkeypatch.setattr(gate.devices, "memory_budget", lambda device, cap=0: 1 << 20)
    reference = _taesd(_Native384)
    probes = gate.probes_for(reference, full_on=torch.device("cpu"))
    fast = modes.build(reference, torch.device("cpu"), modes.Mode(torch.bfloat16))
    report = gate.run(fast, probes)
    assert "full" not in {c.name for c in report.checks}
    assert probes.full_skipped.startswith("needs ") and "GiB free" in probes.full_skipped


def test_vae_gate_full_on_shows_the_check_in_models(flux_store, monkeypatch):
    # a small native size: the check's cost on any CPU (its own size is tested above)
    monkeypatch.setattr(family("flux").decoder.module, "native_size", (256, 192))
    runtime = _runtime(flux_store, dtype="bfloat16", gate_full="on")
    model = runtime.models["flux-tiny"]
    assert "full" in {c.name for c in model.gate.checks}
    assert model.describe()["full_check"] == "run"
    # "off" is the probes' (none made at full size), whatever the mode: the exact path alone
    off = _runtime(flux_store, dtype="float32", gate_full="off").models["flux-tiny"]
    assert off.describe()["full_check"] == "off"


def test_one_candidate_is_served_without_timing_or_gating(tmp_path, monkeypatch):
    """Issue 36.7: ``VAE_DTYPE=float32`` on a CPU has one candidate, the exact path itself:
    the start decodes nothing (no probe timed, no reference output computed), even with no
    stored gate reference; what ``python -m app decode`` waits for is the weights' load."""
    from app.config import Settings
    from app.runtime import Runtime
    from app.telemetry.metrics import Metrics
    from tests.live import TINY_FLUX, bake

    store = tmp_path / "store"
    bake(store, "flux", "flux-tiny", TINY_FLUX["flux-tiny"])  # no gate reference stored
    ran: list[str] = []
    for probes in (gate.DecoderProbes, gate.EncoderProbes):
        real_run, real_expected = probes.run_plain, probes.expected
        monkeypatch.setattr(
            probes, "run_plain", lambda self, fast, r=real_run: ran.append("run") or r(self, fast)
        )
        monkeypatch.setattr(
            probes,
            "expected",
            lambda self, name, e=real_expected: ran.append(name) or e(self, name),
        )
    runtime = Runtime(Settings(models_dir=store, device="cpu", dtype="float32"), Metrics())
    runtime.load_all()
    served = runtime.models["flux-tiny"]
    assert ran == [] and served.fast is served.reference
    assert served.chosen_because == "the only candidate: the exact path"
    assert [c["probe_seconds"] for c in served.candidates] == [None]
