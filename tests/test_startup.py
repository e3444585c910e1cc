"""Startup: gate references made once (missing, stale, tampered), the served mode chosen by a
measured time, a tiled gate that really tiles, per-model state, and a compile that runs while
the service serves."""

from __future__ import annotations

import json
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import requests
import torch
from safetensors.torch import load_file, safe_open, save_file

import app.families
from app.config import Settings
from app.families import tiling
from app.families.hunyuan_video import decoder as hunyuan_video
from app.http.decode import resolve_model
from app.protocol.errors import ProtocolError
from app.protocol.request import DecodeRequest, EncodeRequest, Output
from app.runtime import Runtime, compiled, gate, modes, references, selection
from app.runtime.parts import ModelState
from app.store import entry_dir, load_model
from app.telemetry.metrics import Metrics
from app.telemetry.timing import PhaseTimer
from tests import launch
from tests.live import TINY_FLUX, bake, live_server, post

REFERENCE = references.REFERENCE_FILE


def _runtime(store, name, **settings) -> Runtime:
    runtime = Runtime(Settings(models_dir=store, models=name, **settings), Metrics())
    runtime.load_all()
    return runtime


def _fresh_expected(store, name) -> dict[str, torch.Tensor]:
    _, decoder = load_model(store, name)
    return gate.probes_for(decoder).all_expected()


@pytest.fixture
def store(tmp_path, sleepy_family):
    """FLUX's tiny decoder whose bf16 copy computes with float32 twin weights (no sleeps):
    the reference file's handling is the test, not bf16 arithmetic (which a CPU without bf16
    kernels emulates at many times float32's cost)."""
    config = {**TINY_FLUX["flux-tiny"], "slow_modes": [], "sleep_s": 0.0}
    bake(tmp_path, "sleepy-flux", "flux-tiny", config)
    return tmp_path


# --- gate references -------------------------------------------------------------------------
def test_a_missing_reference_is_computed_written_and_then_used(store, monkeypatch, caplog):
    assert not (entry_dir(store, "flux-tiny") / REFERENCE).exists()  # write_model alone
    with caplog.at_level(logging.INFO, logger="app.runtime"):
        first = _runtime(store, "flux-tiny", dtype="bfloat16").models["flux-tiny"]
    assert first.reference_status == "missing"
    # the serving line says what was found and that it was made since, not "missing" alone
    (serving,) = [r.getMessage() for r in caplog.records if ": serving " in r.getMessage()]
    assert serving.endswith("gate reference missing at load, recomputed"), serving
    stored = load_file(str(entry_dir(store, "flux-tiny") / REFERENCE))
    expected = _fresh_expected(store, "flux-tiny")
    assert set(stored) == {"plain", "denormalized", "tiled"}
    assert all(torch.equal(stored[k], expected[k]) for k in expected)

    # the next start decodes the probes on the candidate path only, never the float32 reference
    float32_decodes = []
    original = type(first.reference).decode

    def counted(self, z, **options):
        if next(self.parameters()).dtype == torch.float32:
            float32_decodes.append(tuple(z.shape))
        return original(self, z, **options)

    monkeypatch.setattr(type(first.reference), "decode", counted)
    second = _runtime(store, "flux-tiny", dtype="bfloat16").models["flux-tiny"]
    assert second.reference_status == "valid" and float32_decodes == []
    assert second.parity_cosine == first.parity_cosine and not second.fallback


def _rewrite(path, tensors=None, **meta_changes) -> None:
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = tensors if tensors is not None else load_file(str(path))
    key = json.loads(meta["key"])
    for k, v in meta_changes.items():
        key[k] = v
    meta["key"] = json.dumps(key, sort_keys=True, separators=(",", ":"))
    path.chmod(0o644)
    save_file(tensors, str(path), metadata=meta)


def test_a_stale_reference_is_recomputed_and_never_used(store, caplog):
    path = entry_dir(store, "flux-tiny") / REFERENCE
    references.store_references(store, "flux-tiny")
    clean = _runtime(store, "flux-tiny", dtype="bfloat16").models["flux-tiny"]
    # another torch wrote it, and its outputs are wrong (but its digest matches them)
    wrong = {k: torch.zeros_like(v) for k, v in load_file(str(path)).items()}
    _rewrite(path, wrong, torch="1.0.0")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    meta["sha256"] = references.tensors_digest(wrong)
    save_file(wrong, str(path), metadata=meta)
    with caplog.at_level(logging.INFO, "app.runtime.references"):
        model = _runtime(store, "flux-tiny", dtype="bfloat16").models["flux-tiny"]
    assert model.reference_status == "stale" and "gate reference stale" in caplog.text
    assert model.parity_cosine == clean.parity_cosine  # the recomputed outputs, not the zeros
    with safe_open(str(path), "pt") as f:  # written back with this process's key
        assert json.loads(f.metadata()["key"])["torch"] == torch.__version__
    stored = load_file(str(path))
    assert torch.equal(stored["plain"], _fresh_expected(store, "flux-tiny")["plain"])


def test_a_tampered_reference_fails_closed(store, caplog):
    path = entry_dir(store, "flux-tiny") / REFERENCE
    references.store_references(store, "flux-tiny")
    _, key_status = references.read(path.parent, {})
    assert key_status == "stale"  # any other key is stale
    # the bf16 copy's own outputs put in the file (the key unchanged): the gate would pass a
    # copy against itself; the digest no longer matches
    model = _runtime(store, "flux-tiny", dtype="bfloat16").models["flux-tiny"]
    forged = {k: v for k, v in load_file(str(path)).items()}
    forged["plain"] = gate.probes_for(model.reference).run_plain(model.fast).float().contiguous()
    _rewrite(path, forged)
    with caplog.at_level(logging.INFO, "app.runtime.references"):
        again = _runtime(store, "flux-tiny", dtype="bfloat16").models["flux-tiny"]
    assert again.reference_status == "tampered"
    assert any(r.levelno == logging.ERROR and "tampered" in r.message for r in caplog.records)
    assert again.parity_cosine == model.parity_cosine < 1.0  # measured against the recomputed
    assert (
        references.read(
            path.parent, references.reference_key(again.manifest, gate.probes_for(again.reference))
        )[1]
        == "valid"
    )


def test_bake_stores_the_reference(tmp_path):
    import sys

    from tests.live import ROOT

    run = launch.run(
        [sys.executable, "-m", "app", "bake", "--synthetic", "--models-dir", str(tmp_path),
         "--only", "ltx2-tiny"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    # read at load whatever the mode (the exact path alone: no bf16 gate to wait for)
    runtime = _runtime(tmp_path, "ltx2-tiny", dtype="float32")
    assert runtime.models["ltx2-tiny"].reference_status == "valid"
    # the encoder's too (its own file beside the decoder's)
    assert (entry_dir(tmp_path, "ltx2-tiny") / references.REFERENCE_FILES["encoder"]).is_file()
    assert runtime.encoders["ltx2-tiny"].reference_status == "valid"


# --- the mode by measurement -----------------------------------------------------------------
def _registered(key: str, module: str):
    """A test stand-in family (``module``'s ``FAMILY``) known as ``key`` while the test runs."""
    app.families.register(key, module)
    yield
    app.families.unregister(key)


@pytest.fixture
def sleepy_family():
    yield from _registered("sleepy-flux", "tests.family_sleepy")


@pytest.fixture
def tiled_family():
    yield from _registered("tiled-hunyuan", "tests.family_tiled")


@pytest.fixture
def sleepy(tmp_path, sleepy_family, monkeypatch):
    # every candidate is measured, bf16 too where the CPU emulates it (the sleepy decoder
    # computes in float32 whatever its dtype: its modes take the time the test gives them)
    monkeypatch.setattr(modes, "cpu_offers_bf16", lambda: True)

    def make(slow_modes: list[str], sleep_s: float = 0.4):
        config = {**TINY_FLUX["flux-tiny"], "slow_modes": slow_modes, "sleep_s": sleep_s}
        bake(tmp_path, "sleepy-flux", "sleepy", config)
        return tmp_path

    return make


def _served_mode(store, **settings) -> tuple[str, dict]:
    from fastapi.testclient import TestClient

    from app.http import create_app

    settings = Settings(models_dir=store, models="sleepy", dtype="auto", **settings)
    with TestClient(create_app(settings, load_in_background=False)) as client:
        (described,) = client.get("/models").json()["models"]
        assert client.get("/readyz").json()["states"]["sleepy"]["state"] == "ready"
    return described["mode"], described


ALL = ["float32", "float32 exact", "bfloat16", "bfloat16 exact"]


@pytest.mark.bf16_order
@pytest.mark.parametrize("fast", ["bfloat16 exact", "float32"])
def test_the_fastest_measured_mode_that_passes_is_served(sleepy, monkeypatch, fast):
    # on a loaded machine one decode of the tiny model can take seconds: a sleep well above
    # that, and every mode its repeats (no early stop on one unlucky first decode)
    monkeypatch.setattr(selection, "CLEARLY_SLOWER", float("inf"))
    store = sleepy([m for m in ALL if m != fast], sleep_s=1.5)
    mode, described = _served_mode(store)
    assert mode == fast, described["candidates"]
    times = {c["mode"]: c["probe_seconds"] for c in described["candidates"]}
    assert set(times) == set(ALL) and min(times, key=times.get) == fast
    assert all(times[m] >= 1.5 for m in ALL if m != fast)
    assert described["chosen_because"] and described["selection"] == "done"
    chosen = next(c for c in described["candidates"] if c["mode"] == fast)
    assert chosen["gated"] and chosen["passed"] and chosen["parity_cosine"] >= 0.9999


def test_repeats_are_taken_in_turns_and_keep_each_best():
    """A load that lands on one candidate's first decode (``a``: 3 s, then 1 s) is repeated
    away in turns with the others; one clearly slower after its first decode is not retimed."""
    first = {"a": 3.0, "b": 1.5, "slow": 9.0}
    later = {"a": [1.0, 1.2], "b": [1.4, 1.6], "slow": [0.1, 0.1]}
    candidates = [SimpleNamespace(name=n, probe_seconds=t) for n, t in first.items()]
    calls = []

    def seconds(candidate):
        calls.append(candidate.name)
        return later[candidate.name][calls.count(candidate.name) - 1]

    selection.retime(candidates, seconds, repeats=3)
    assert calls == ["a", "b", "a", "b"]
    assert [c.probe_seconds for c in candidates] == [1.0, 1.4, 9.0]
    assert selection.ranked(candidates)[0].name == "a"


def test_a_candidate_measured_alone_is_not_retimed():
    """One candidate (a forced ``VAE_DTYPE``): nothing to compare its time with."""
    alone = [SimpleNamespace(name="only", probe_seconds=2.0)]
    calls = []
    selection.retime(alone, lambda c: calls.append(c.name) or 1.0, repeats=3)
    assert calls == [] and alone[0].probe_seconds == 2.0
    failed = [SimpleNamespace(name="broken", probe_seconds=None), *alone]
    selection.retime(failed, lambda c: calls.append(c.name) or 1.0, repeats=3)
    assert calls == []  # a candidate that could not run is not a comparison


@pytest.mark.bf16_order(set_by_test=True)
@pytest.mark.parametrize("native_bf16", ["1", "0"])
def test_cpu_flags_only_order_the_candidates(sleepy, monkeypatch, native_bf16):
    """All four equally slow (within the tie margin): the first in the order wins, and the
    order is what ``VAE_CPU_FAST_BF16`` says."""
    monkeypatch.setenv("VAE_CPU_FAST_BF16", native_bf16)
    monkeypatch.setattr(selection, "TIE", 1.5)  # a loaded machine's decode jitter stays inside
    store = sleepy(ALL, sleep_s=2.0)  # a first decode's own time, under load, stays inside the tie
    mode, described = _served_mode(store, gate_repeats=1)
    order = [c["mode"] for c in described["candidates"]]
    first = "bfloat16" if native_bf16 == "1" else "float32"
    assert order[0] == first and mode == first, described["candidates"]


@pytest.mark.bf16_order(set_by_test=True)
def test_a_slower_mode_is_not_served_because_of_the_cpu_flags(sleepy, monkeypatch):
    monkeypatch.setenv("VAE_CPU_FAST_BF16", "1")  # bf16 first in the order, but measured slower
    store = sleepy(["bfloat16", "bfloat16 exact", "float32 exact"])
    mode, _ = _served_mode(store)
    assert mode == "float32"


@pytest.mark.bf16_order
def test_the_exact_path_serves_first_then_the_measured_mode(sleepy, monkeypatch):
    """VAE_SELECT=auto on the CPU: ready on the exact path, the winner swapped in after."""
    # every mode its repeats, as in the test above (no early stop on a loaded machine)
    monkeypatch.setattr(selection, "CLEARLY_SLOWER", float("inf"))
    store = sleepy(["float32", "float32 exact", "bfloat16 exact"], sleep_s=1.5)
    with live_server(store, selected=False, models="sleepy", dtype="auto") as url:
        ready = requests.get(f"{url}/readyz")
        assert ready.status_code == 200
        (early,) = requests.get(f"{url}/models").json()["models"]
        assert early["mode"] == "float32 exact" and early["path"] == "exact"
        assert early["selection"] in ("pending", "measuring")
        deadline = time.monotonic() + 120  # ends once done: a loaded machine is slow
        while time.monotonic() < deadline:
            (late,) = requests.get(f"{url}/models").json()["models"]
            if late["selection"] == "done":
                break
            time.sleep(0.2)
        assert late["mode"] == "bfloat16" and late["path"] == "optimized", json.dumps(late)


@pytest.mark.bf16_order
def test_the_selection_is_done_only_once_the_winner_serves(sleepy, monkeypatch):
    """``/models`` said "done" a moment before the winner was swapped in: a poll between the
    two read the exact path as the final choice (three full-suite runs failed the test above
    so, with no candidate listed). Whenever the selection turns done, the winner serves."""
    # the slept modes lose by 1.5 s a decode, as in the test above (a loaded machine)
    monkeypatch.setattr(selection, "CLEARLY_SLOWER", float("inf"))
    store = sleepy(["float32", "float32 exact", "bfloat16 exact"], sleep_s=1.5)
    runtime = Runtime(Settings(models_dir=store, models="sleepy", dtype="auto"), Metrics())
    served_when_done = []

    def watch(state, name, value):
        object.__setattr__(state, name, value)
        if name == "selection" and value == "done":
            served_when_done.append(runtime.registry.models["sleepy"].describe()["mode"])

    monkeypatch.setattr(ModelState, "__setattr__", watch)
    runtime.load_all()
    assert served_when_done == ["bfloat16"]


# --- the tiled gate ----------------------------------------------------------------------------
def test_the_tiled_check_decodes_more_than_one_tile(tmp_path, tiled_family):
    config = hunyuan_video.SYNTHETIC["hunyuan-video-tiny"]
    bake(tmp_path, "tiled-hunyuan", "tiled", config)
    model = _runtime(tmp_path, "tiled", dtype="bfloat16").models["tiled"]
    probes = gate.probes_for(model.reference)
    assert probes.tiled is not None
    assert tiling.sample_grid(probes.tiled, {}, model.reference.spatial_scale)
    assert len(tiling.sample_grid(probes.tiled, {}, 8).tiles) == 4
    assert "tiled" in {c.name for c in model.gate.checks} and model.tiled_gated


def test_a_tiled_decode_whose_check_failed_runs_on_the_exact_path(tmp_path, tiled_family):
    """A fast copy whose tiles are wrong: untiled decodes are served on it, tiled ones on the
    exact path (never a path the gate did not pass)."""
    config = {**hunyuan_video.SYNTHETIC["hunyuan-video-tiny"], "break_tiled": True}
    bake(tmp_path, "tiled-hunyuan", "broken", config)
    runtime = _runtime(tmp_path, "broken", dtype="bfloat16")
    model = runtime.models["broken"]
    tiled = next(c for c in model.gate.checks if c.name == "tiled")
    assert tiled.cosine < 0.9999 and not model.fallback and not model.tiled_gated
    assert model.decoder_for(True) is model.reference and model.decoder_for(False) is model.fast
    z = torch.randn(1, 16, 1, 36, 36)
    tiled = DecodeRequest(z, Output.TENSOR, options={"tiled": True})
    out = runtime.runner.decode(model, tiled, PhaseTimer())
    assert torch.equal(out, model.reference.decode(z, tiled=True))
    untiled = runtime.runner.decode(model, DecodeRequest(z, Output.TENSOR), PhaseTimer())
    assert torch.equal(untiled, model.fast.decode(z.float()).float())


def test_a_latent_over_the_decode_cap_is_decoded_tiled_on_the_gated_path(tmp_path, tiled_family):
    """A latent whose untiled plan exceeds ``VAE_MAX_DECODE_MB`` (the 413 admits it on its
    tiled plan) is decoded tiled, whole and streamed, though the host holds the whole decode;
    here the fast copy's tiles failed the gate, so the tiles run on the exact path."""
    config = {**hunyuan_video.SYNTHETIC["hunyuan-video-tiny"], "break_tiled": True}
    bake(tmp_path, "tiled-hunyuan", "broken", config)
    z = torch.randn(1, 16, 1, 36, 36)
    fast = _runtime(tmp_path, "broken", dtype="bfloat16").models["broken"].fast
    size = next(fast.parameters()).element_size()  # the runner plans the served copy's
    whole, tiled = (
        fast.planned_bytes(tuple(z.shape), size),
        fast.planned_bytes(tuple(z.shape), size, tiled=True),
    )
    assert tiled < whole, "the probe latent must plan less tiled than whole"
    cap_mb = -(-tiled // (1 << 20))  # the tiled plan fits the cap, the whole one does not
    assert whole > cap_mb << 20
    runtime = _runtime(tmp_path, "broken", dtype="bfloat16", max_decode_mb=cap_mb)
    model = runtime.models["broken"]
    expected = model.reference.decode(z, tiled=True)
    out = runtime.runner.decode(model, DecodeRequest(z, Output.TENSOR), PhaseTimer())
    assert torch.equal(out, expected)
    streamed = list(runtime.runner.stream(model, DecodeRequest(z, Output.TENSOR), PhaseTimer()))
    assert torch.equal(torch.cat(streamed, 2), expected)


def test_an_input_over_the_encode_cap_is_encoded_tiled_on_the_exact_path(tmp_path):
    """A clip whose untiled encode plans more than ``VAE_MAX_DECODE_MB`` is encoded in the
    reference's spatial tiles, on the exact path (the encoder gate has no tiled check)."""
    config = hunyuan_video.SYNTHETIC["hunyuan-video-tiny"]
    bake(tmp_path, "hunyuan-video", "hv", config, encoder=True)
    x = torch.rand(1, 3, 5, 264, 264, generator=torch.Generator().manual_seed(0)) * 2 - 1
    part = _runtime(tmp_path, "hv", dtype="bfloat16").encoders["hv"]
    size = next(part.active.parameters()).element_size()
    whole = part.active.planned_bytes(tuple(x.shape), size)
    tiled = part.active.planned_bytes(tuple(x.shape), size, tiled=True)
    cap_mb = -(-tiled // (1 << 20))
    assert whole > cap_mb << 20, "the clip must plan more than the cap whole"
    runtime = _runtime(tmp_path, "hv", dtype="bfloat16", max_decode_mb=cap_mb)
    part = runtime.encoders["hv"]
    assert not part.tiled_gated and part.decoder_for(True) is part.reference
    chunks = list(runtime.runner.encode_chunks(part, EncodeRequest(x), PhaseTimer()))
    with torch.inference_mode():
        expected = part.reference.moments(x, tiled=True)
    assert torch.equal(torch.cat(chunks, 2), expected)
    assert not torch.equal(expected, part.reference.moments(x))  # the tiles are seen


# --- state, metrics, compile -------------------------------------------------------------------
def test_a_default_model_that_is_not_loaded_is_said_at_startup(store, caplog):
    with caplog.at_level(logging.WARNING, logger="app.runtime.registry"):
        runtime = _runtime(store, "flux-tiny", default_model="flux-tinny", dtype="float32")
    serving = SimpleNamespace(runtime=runtime, settings=runtime.settings)
    with pytest.raises(ProtocolError) as refused:  # a request that names no model
        resolve_model(None, None, serving)
    assert refused.value.status == 404
    assert refused.value.error == "VAE_DEFAULT_MODEL's model 'flux-tinny' not found"
    assert refused.value.expected == "flux-tiny"
    said = [r.getMessage() for r in caplog.records if "VAE_DEFAULT_MODEL" in r.getMessage()]
    assert said == ["VAE_DEFAULT_MODEL=flux-tinny names no model this service loads "
                    "(flux-tiny): a request that names no model gets a 404"], said  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="app.runtime.registry"):
        _runtime(store, "flux-tiny", default_model="flux-tiny", dtype="float32")
    assert not [r for r in caplog.records if "VAE_DEFAULT_MODEL" in r.getMessage()]


def test_readyz_and_models_report_each_models_state_and_phases(store, tmp_path_factory):
    bad = tmp_path_factory.mktemp("bad")
    bake(bad, "flux", "ok", TINY_FLUX["flux-tiny"])
    bake(bad, "flux", "broken", TINY_FLUX["flux-tiny"])
    (entry_dir(bad, "broken") / "decoder.safetensors").write_bytes(b"not weights")
    with live_server(bad, dtype="bfloat16", ready_partial=True) as url:
        body = requests.get(f"{url}/readyz").json()
        assert body["states"]["ok"]["state"] == "ready"
        assert body["states"]["broken"]["state"] == "failed" and body["states"]["broken"]["error"]
        (ok,) = requests.get(f"{url}/models").json()["models"]
        assert set(ok["phase_seconds"]) == {"hash", "map", "build", "gate"}
        assert ok["state_seconds"]["ready"] >= ok["state_seconds"]["gating"] >= 0
        metrics = requests.get(f"{url}/metrics").text
        for phase in ("hash", "map", "build", "gate", "total"):
            assert f'vae_model_load_seconds{{model="ok",phase="{phase}"}}' in metrics


def test_a_request_is_served_while_a_compile_runs(store, monkeypatch, tmp_path_factory):
    """VAE_COMPILE=on on the CPU, the compile held: /readyz 200 and a decode served before the
    compile ends; then the gated graph is swapped in."""
    release, started = threading.Event(), threading.Event()
    real = compiled.compiler

    def held(fn, **kwargs):
        started.set()
        assert release.wait(60)
        return real(fn, backend="eager", **kwargs)

    monkeypatch.setattr(compiled, "compiler", held)
    cache = tmp_path_factory.mktemp("compile-cache")
    settings = dict(
        models="flux-tiny", dtype="bfloat16", compile="on", warmup_shapes="1x16x8x8",
        compile_cache_dir=cache,
    )  # fmt: skip
    with live_server(store, **settings) as url:
        assert started.wait(60)
        assert requests.get(f"{url}/readyz").status_code == 200
        post(url, "flux-tiny", torch.randn(1, 16, 8, 8), output_type="pt")  # asserts a 200
        (model,) = requests.get(f"{url}/models").json()["models"]
        assert model["compiled_shapes"] == []
        release.set()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not model["compiled_shapes"]:
            time.sleep(0.2)
            (model,) = requests.get(f"{url}/models").json()["models"]
        assert model["compiled_shapes"] == [[1, 16, 8, 8]]
        assert "compile" in model["phase_seconds"]
