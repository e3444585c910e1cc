"""The parity gate and the float32 CPU fallback, exercised on the CPU (bf16 fast path).

Nothing here assumes what this CPU has: ``auto`` is checked for the path it chose, and both
of its branches are forced with ``VAE_CPU_FAST_BF16``."""

from __future__ import annotations

import pytest
import requests
import torch
from fastapi.testclient import TestClient

from app import fastpath
from app.config import Settings
from app.decoders.ops import cosine
from app.engine import Engine, Scaling
from app.metrics import Metrics
from app.service import create_app
from app.store import load_model
from app.timing import PhaseTimer
from tests.live import live_server


def _engine(store, **settings) -> Engine:
    engine = Engine(Settings(models_dir=store, models="flux-tiny", **settings), Metrics())
    engine.load_all()
    return engine


def test_bf16_fast_path_passes_the_gate_and_stays_close(flux_store):
    engine = _engine(flux_store, dtype="bfloat16")
    model = engine.models["flux-tiny"]
    assert not model.fallback and model.dtype == torch.bfloat16
    assert 0.9999 <= model.parity_cosine < 1.0  # a real comparison, not a copy of itself
    assert next(model.fast.parameters()).dtype == torch.bfloat16
    z = torch.randn(1, 16, 8, 8)
    fast = engine.decode(model, z, Scaling(), {}, PhaseTimer())
    exact = model.reference.decode(z)
    cos = torch.nn.functional.cosine_similarity(
        fast.flatten().double(), exact.flatten().double(), 0
    )
    assert cos >= 0.9999 and fast.dtype == torch.float32


def test_unreachable_threshold_falls_back_to_float32_cpu(flux_store):
    engine = _engine(flux_store, dtype="bfloat16", parity_min_cos=1.01)
    model = engine.models["flux-tiny"]
    assert model.fallback and "parity cosine" in model.reason
    assert model.active is model.reference
    text = engine.metrics.exposition().decode()
    assert 'vae_fallback_active{model="flux-tiny"} 1.0' in text
    z = torch.randn(1, 16, 8, 8)
    out = engine.decode(model, z, Scaling(), {}, PhaseTimer())
    _, fresh = load_model(flux_store, "flux-tiny")
    assert torch.equal(out, fresh.decode(z))  # the exact path, bit for bit
    assert engine.ready


def test_fallback_off_keeps_readyz_503_with_the_reason(flux_store):
    settings = dict(dtype="bfloat16", parity_min_cos=1.01, fallback="off", models="flux-tiny")
    with live_server(flux_store, **settings) as url:
        ready = requests.get(f"{url}/readyz")
        assert ready.status_code == 503
        assert "parity cosine" in ready.json()["reason"] and "flux-tiny" in ready.json()["reason"]
        models = requests.get(f"{url}/models").json()
        assert "flux-tiny" in models["errors"]
        # the failing cosine is exported, not only written in /readyz's text
        metrics = requests.get(f"{url}/metrics").text
        (line,) = [m for m in metrics.splitlines() if m.startswith("vae_parity_cosine{")]
        assert 'model="flux-tiny"' in line and 0.99 < float(line.split()[-1]) < 1.01


def test_fallback_cpu_is_reported_in_models(flux_store):
    with live_server(flux_store, dtype="bfloat16", parity_min_cos=1.01, models="flux-tiny") as url:
        assert requests.get(f"{url}/readyz").status_code == 200
        (model,) = requests.get(f"{url}/models").json()["models"]
        assert model["fallback"] is True and model["device"] == "cpu"
        assert model["dtype"] == "float32" and "parity cosine" in model["fallback_reason"]
        assert model["path"] == "exact"


def _served(store, **settings) -> tuple[dict, Engine]:
    """The app's own ``/models`` entry for flux-tiny (loaded in-process), and its engine."""
    app = create_app(Settings(models_dir=store, models="flux-tiny", **settings),
                     load_in_background=False)  # fmt: skip
    with TestClient(app) as client:
        (described,) = client.get("/models").json()["models"]
    return described, app.state.engine


def test_auto_serves_a_gated_optimized_path(flux_store):
    """auto: channels_last + upsample rewrite + banded GroupNorm, still within the gate, in
    whichever dtype this CPU gets (bf16 with native bf16, else float32)."""
    described, engine = _served(flux_store, dtype="auto")
    model = engine.models["flux-tiny"]
    expected = "bfloat16" if fastpath.cpu_has_fast_bf16() else "float32"
    assert described["dtype"] == expected and described["path"] == "optimized"
    assert not described["fallback"] and model.fast is not model.reference
    assert model.fast.band_bytes > 0
    model.fast.band_min_pixels = 0  # tiny latents: force the banded path on
    assert model.fast.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert described["parity_cosine"] >= 0.9999
    z = torch.randn(1, 16, 9, 7)
    out = engine.decode(model, z, Scaling(), {}, PhaseTimer())
    exact = model.reference.decode(z)
    if expected == "float32":
        assert (out - exact).abs().max() < 1e-3  # the same arithmetic, reordered
    else:
        assert cosine(out, exact) >= 0.9999  # what the gate promises for bf16


@pytest.mark.parametrize("native_bf16", ["1", "0"])
def test_auto_takes_bf16_only_on_a_cpu_with_native_bf16(flux_store, monkeypatch, native_bf16):
    """Both branches of ``auto`` on any CPU: as if it had native bf16, and as if it lacked it."""
    monkeypatch.setenv("VAE_CPU_FAST_BF16", native_bf16)
    assert fastpath.cpu_has_fast_bf16() is (native_bf16 == "1")
    described, _ = _served(flux_store, dtype="auto")
    assert described["dtype"] == ("bfloat16" if native_bf16 == "1" else "float32")
    assert described["path"] == "optimized" and not described["fallback"]
    assert 0.9999 <= described["parity_cosine"]


def test_float32_is_the_exact_path(flux_store):
    engine = _engine(flux_store, dtype="float32")
    model = engine.models["flux-tiny"]
    assert model.fast is model.reference and model.parity_cosine == 1.0
