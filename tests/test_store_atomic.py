"""The store under crashes, races and edited manifests, driven through `python -m app import`.

A writer stops itself at a named step (``VAE_STORE_PAUSE_AT``, app/store/__init__.py); the test then
kills it (SIGKILL) or lets it go on (SIGCONT) and checks what the store serves: always one
whole entry, its manifest's source and config matching its weights, every hash verified.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from diffusers import AutoencoderKL

from app.families import family
from app.store import (
    ENTRIES,
    PAUSE_ENV,
    StoreError,
    entry_dir,
    load_encoder,
    load_model,
    verify_entry,
    write_model,
)
from tests import launch, store_encoder
from tests.conftest import ROOT
from tests.live import live_server
from tests.test_store import CFG

STEPS_BEFORE_PUBLISH = ["locked", "decoder", "manifest"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, dict]:
    """Two diffusers checkpoints that differ in weights and in their config's scaling factor,
    each with what an entry made from it must hold (its decoder sha256 and config)."""
    root = tmp_path_factory.mktemp("sources")
    out = {}
    for label, seed, factor in (("a", 1, 0.9), ("b", 2, 0.5)):
        torch.manual_seed(seed)
        AutoencoderKL(**CFG, scaling_factor=factor).save_pretrained(root / label)
        config, state = family("flux").decoder.convert(root / label)
        reference = write_model(root / "ref", label, "flux", config, state, source=label)
        out[label] = {
            "path": root / label,
            "sha256": reference.sha256,
            "config": reference.config,
            "factor": factor,
        }
    return out


def _start(store: Path, source: Path, pause: str | None = None, log: Path | None = None):
    env = {**os.environ, PAUSE_ENV: pause or ""}
    args = [sys.executable, "-m", "app", "import", "flux", str(source), "--name", "m"]
    args += ["--no-references"]  # the entry's writes are under test, not the gate's decodes
    err = open(log, "w") if log else subprocess.PIPE  # noqa: SIM115 (the child holds it)
    return launch.popen(
        [*args, "--models-dir", str(store)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err
    )


def _wait_stopped(proc: launch.Process, timeout: float = 180) -> None:
    """Until the writer has stopped itself (state T in /proc); fails if it exits instead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode} before pausing"
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the writer never reached its pause step")


def _kill_at(store: Path, source: Path, step: str) -> None:
    proc = _start(store, source, pause=step)
    _wait_stopped(proc)
    proc.kill()
    proc.wait(30)


def _served(store: Path, sources: dict) -> str:
    """Which source the entry holds, after checking it is that source as a whole."""
    manifest, decoder = load_model(store, "m", verify=True)
    label = Path(manifest.source).name
    assert manifest.parts["decoder"]["sha256"] == sources[label]["sha256"], "weights mixed"
    assert manifest.config == sources[label]["config"], "config mixed"
    assert decoder.config["scaling_factor"] == sources[label]["factor"]
    return label


def _versions(store: Path) -> list[str]:
    return sorted(p.name for p in (store / ENTRIES).iterdir())


def _seed(store: Path, source: Path) -> None:
    config, state = family("flux").decoder.convert(source)
    write_model(store, "m", "flux", config, state, source=str(source.resolve()))


@pytest.mark.parametrize("step", [*STEPS_BEFORE_PUBLISH, "published"])
def test_a_killed_import_leaves_the_old_entry_or_the_new(step, sources, tmp_path):
    store = tmp_path / "store"
    _seed(store, sources["a"]["path"])
    _kill_at(store, sources["b"]["path"], step)
    assert _served(store, sources) == ("b" if step == "published" else "a")
    done = _start(store, sources["b"]["path"])  # the next import cleans what the kill left
    assert done.wait(180) == 0, done.stderr.read()
    assert _served(store, sources) == "b"
    assert _versions(store) == [entry_dir(store, "m").name]


def test_a_flat_entry_of_an_older_store_loads_and_is_replaced_atomically(sources, tmp_path):
    store = tmp_path / "store"
    _seed(store, sources["a"]["path"])
    _flatten(store)
    assert _served(store, sources) == "a"
    _kill_at(store, sources["b"]["path"], "manifest")
    assert (store / "m").is_dir() and not (store / "m").is_symlink()
    assert _served(store, sources) == "a"
    _kill_at(store, sources["b"]["path"], "published")
    assert (store / "m").is_symlink() and _served(store, sources) == "b"


def _flatten(store: Path) -> None:
    """Turn entry ``m`` into the older flat layout: DIR/m/manifest.json + decoder.safetensors,
    a manifest without parts and integrity."""
    version = entry_dir(store, "m")
    (store / "m").unlink()
    shutil.copytree(version, store / "m")
    shutil.rmtree(store / ENTRIES)
    old = json.loads((store / "m" / "manifest.json").read_text())
    for key in ("parts", "integrity"):
        del old[key]
    (store / "m" / "manifest.json").write_text(json.dumps(old))


def test_a_flat_entry_is_replaced_where_paths_cannot_be_exchanged(sources, tmp_path, monkeypatch):
    """Without renameat2 (not Linux): the flat folder is moved aside, then the link placed."""
    import app.store.write

    store = tmp_path / "store"
    _seed(store, sources["a"]["path"])
    _flatten(store)
    monkeypatch.setattr(app.store.write, "_exchange", lambda a, b: False)
    _seed(store, sources["b"]["path"])
    assert (store / "m").is_symlink() and _served(store, sources) == "b"
    assert _versions(store) == [entry_dir(store, "m").name]


@pytest.mark.parametrize("step", ["decoder", "manifest"])
def test_two_imports_of_one_name_serialize(step, sources, tmp_path):
    """A pauses holding the lock; B starts, says it waits, and does; A resumes: both succeed
    and the entry is B's as a whole (the issue's round ended with A's manifest over B's
    weights)."""
    store, log = tmp_path / "store", tmp_path / "b.log"
    first = _start(store, sources["a"]["path"], pause=step)
    _wait_stopped(first)
    second = _start(store, sources["b"]["path"], log=log)
    deadline = time.monotonic() + 180
    while "waiting for another write of m" not in log.read_text():
        assert second.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    time.sleep(0.5)
    assert second.poll() is None  # still waiting: A holds the lock
    os.kill(first.pid, signal.SIGCONT)
    assert first.wait(180) == 0, first.stderr.read()
    assert second.wait(180) == 0, log.read_text()
    assert _served(store, sources) == "b"
    assert _versions(store) == [entry_dir(store, "m").name]


def test_an_edited_config_is_refused_at_startup(sources, tmp_path):
    store = tmp_path / "store"
    _seed(store, sources["a"]["path"])
    manifest = json.loads((store / "m" / "manifest.json").read_text())
    manifest["config"]["scaling_factor"] = 0.5  # what mixing two imports looked like
    (store / "m" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"^m: manifest.json was edited"):
        load_model(store, "m")
    latent = tmp_path / "z.npy"
    np.save(latent, np.zeros((1, 16, 4, 4), np.float32))
    done = launch.run(
        [sys.executable, "-m", "app", "decode", str(latent), "--model", "m", "-o",
         str(tmp_path / "out.png"), "--models-dir", str(store), "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0 and "manifest.json was edited" in done.stderr, done.stderr


# A manifest without the integrity hash (as older stores have) whose config says a channel
# count its weights do not have: refused from the header, nothing built. Prints the seconds
# and the peak RSS the load added.
OVERSIZED_LOADER = """
import resource, sys, time
from app.store import StoreError, load_model
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
try:
    load_model(sys.argv[1], "m")
    print("LOADED")
except StoreError as exc:
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(f"{time.perf_counter() - t0:.3f} {grown // 1024}")
    print(exc)
"""


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("latent_channels", 2048, "the config gives conv_in.weight the shape [64, 2048, 3, 3], "
         "the weights [64, 16, 3, 3]"),
        ("block_out_channels", [32, 64, 1_000_000], "weights do not fit the config: missing"),
        ("layers_per_block", 1_000_000, "the weights hold 86 tensors, its config builds far"),
    ],
)  # fmt: skip
def test_a_config_that_does_not_fit_the_weights_is_refused_before_building(
    key, value, named, sources, tmp_path
):
    store = tmp_path / "store"
    _seed(store, sources["a"]["path"])
    path = store / "m" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["integrity"]
    manifest["config"][key] = value
    path.write_text(json.dumps(manifest))
    done = launch.run([sys.executable, "-c", OVERSIZED_LOADER, str(store)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    timing, message = done.stdout.strip().splitlines()[-2:]
    seconds, grown_mb = timing.split()
    assert message.startswith(f"m: decoder.safetensors: {named}"), message
    if key != "layers_per_block":  # that one is stopped before it is built at all
        assert "MB of weights, decoder.safetensors holds 2.4 MB" in message
    assert float(seconds) < 5 and int(grown_mb) < 100, timing  # the real build: GBs, seconds


BAKE_ONE = ["bake", "--synthetic", "--only", "minimax-h3-tiny", "--no-references"]


def _bake(store: Path, pause: str = "") -> launch.Process:
    return launch.popen(
        [sys.executable, "-m", "app", *BAKE_ONE, "--models-dir", str(store)], cwd=ROOT,
        env={**os.environ, PAUSE_ENV: pause}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def test_bake_never_takes_a_killed_or_corrupt_entry_for_done(tmp_path):
    killed = _bake(tmp_path, pause="manifest")
    _wait_stopped(killed)
    killed.kill()
    killed.wait(30)
    assert not (tmp_path / "minimax-h3-tiny").exists()  # written in full, never published
    first = _bake(tmp_path)
    assert first.wait(300) == 0 and "baked minimax-h3-tiny" in first.stdout.read()
    assert len(_versions(tmp_path)) == 1  # what the kill left is gone
    weights = tmp_path / "minimax-h3-tiny" / "decoder.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    again = _bake(tmp_path)
    assert again.wait(300) == 0 and "rebaking minimax-h3-tiny" in again.stderr.read()
    verify_entry(tmp_path, "minimax-h3-tiny")


# --- the encoder part -------------------------------------------------------------------------

ENCODER_WRITER = """
import sys
from tests import store_encoder
store_encoder.register()
from app.families import family
from app.store import write_model
from safetensors.torch import load_file
config, state = family(store_encoder.KEY).decoder.convert(sys.argv[2])
write_model(sys.argv[1], "m", store_encoder.KEY, config, state, source=sys.argv[2],
            encoder_state=load_file(sys.argv[3]), encoder_config={"width": 8})
"""
ENCODED = store_encoder.KEY  # FLUX's decoder with the stand-in encoder (tests/store_encoder.py)


@pytest.fixture
def stand_in_encoder():
    """FLUX's decoder with a stand-in encoder, for these tests: the family of
    tests/store_encoder.py, known while the test runs."""
    with store_encoder.registered():
        yield


def _encoder_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"conv_in.weight": torch.randn(8, 3, 3, 3, generator=g), "conv_in.bias": torch.zeros(8)}


def test_an_entry_holds_an_encoder_beside_its_decoder(sources, tmp_path, stand_in_encoder):
    store = tmp_path / "store"
    config, state = family("flux").decoder.convert(sources["a"]["path"])
    write_model(store, "dec-only", ENCODED, config, state, source="a")
    with pytest.raises(StoreError, match=r"^dec-only holds no encoder"):
        load_encoder(store, "dec-only")
    encoder = _encoder_state(0)
    written = write_model(store, "both", ENCODED, config, state, source="a",
                          encoder_state=encoder, encoder_config={"width": 8})  # fmt: skip
    assert set(written.parts) == {"decoder", "encoder"}
    manifest, tensors = load_encoder(store, "both", verify=True)
    assert manifest.encoder_config == {"width": 8}
    assert tensors.keys() == encoder.keys()
    assert all(torch.equal(tensors[k], encoder[k]) for k in encoder)
    verify_entry(store, "both")


def test_a_write_killed_after_its_encoder_leaves_the_old_entry(sources, tmp_path, stand_in_encoder):
    store, new_encoder = tmp_path / "store", tmp_path / "encoder.safetensors"
    config, state = family("flux").decoder.convert(sources["a"]["path"])
    write_model(store, "m", ENCODED, config, state, source=str(sources["a"]["path"]),
                encoder_state=_encoder_state(0), encoder_config={"width": 8})  # fmt: skip
    from safetensors.torch import save_file

    save_file(_encoder_state(1), str(new_encoder))
    args = [sys.executable, "-c", ENCODER_WRITER, str(store), str(sources["b"]["path"]),
            str(new_encoder)]  # fmt: skip
    proc = launch.popen(args, cwd=ROOT, env={**os.environ, PAUSE_ENV: "encoder"})
    _wait_stopped(proc)
    proc.kill()
    proc.wait(30)
    assert _served(store, sources) == "a"
    _, tensors = load_encoder(store, "m", verify=True)
    assert torch.equal(tensors["conv_in.weight"], _encoder_state(0)["conv_in.weight"])


def test_encoder_weights_are_checked_against_the_family_encoder(
    sources, tmp_path, stand_in_encoder
):
    store = tmp_path / "store"
    config, state = family("flux").decoder.convert(sources["a"]["path"])
    with pytest.raises(StoreError, match=r"^m: encoder: the config gives conv_in.weight the shape"):
        write_model(store, "m", ENCODED, config, state, source="a",
                    encoder_state=_encoder_state(0), encoder_config={"width": 16})  # fmt: skip
    assert not (store / "m").exists()  # refused before anything was written
    write_model(store, "m", ENCODED, config, state, source="a",
                encoder_state=_encoder_state(0), encoder_config={"width": 8})  # fmt: skip
    path = store / "m" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["integrity"]  # an older manifest, or one written by hand
    manifest["parts"]["encoder"]["config"]["width"] = 1_000_000
    path.write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"^m: encoder.safetensors: the config gives"):
        load_encoder(store, "m")


def test_extra_files_are_published_with_their_entry_or_not_at_all(sources, tmp_path):
    """``extras`` (where gate references go) writes into the version before it is published."""
    store = tmp_path / "store"
    config, state = family("flux").decoder.convert(sources["a"]["path"])

    def reference(folder: Path, manifest) -> None:
        (folder / "gate.json").write_text(json.dumps({"sha256": manifest.sha256}))

    first = write_model(store, "m", "flux", config, state, source="a", extras=reference)
    assert json.loads((entry_dir(store, "m") / "gate.json").read_text())["sha256"] == first.sha256

    def failing(folder: Path, manifest) -> None:
        (folder / "gate.json").write_text("half")
        raise RuntimeError("gate failed")

    _, other = family("flux").decoder.convert(sources["b"]["path"])
    with pytest.raises(RuntimeError):
        write_model(store, "m", "flux", config, other, source="b", extras=failing)
    assert json.loads((entry_dir(store, "m") / "gate.json").read_text())["sha256"] == first.sha256
    assert load_model(store, "m", verify=True)[0].source == "a"
    assert _versions(store) == [entry_dir(store, "m").name]  # the failed one removed itself


def test_the_server_serves_the_old_entry_after_a_killed_import_and_names_edited_ones(
    sources, tmp_path
):
    """At startup on loopback: the entry a killed import was replacing serves as it was; an
    edited manifest and a config wider than its weights are named in /readyz, not built."""
    store = tmp_path / "store"
    for name in ("m", "edited", "wide"):
        config, state = family("flux").decoder.convert(sources["a"]["path"])
        write_model(store, name, "flux", config, state, source=str(sources["a"]["path"]))
    _kill_at(store, sources["b"]["path"], "manifest")
    for name, key, value, drop in (("edited", "scaling_factor", 0.5, False),
                                   ("wide", "latent_channels", 2048, True)):  # fmt: skip
        path = store / name / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["config"][key] = value
        if drop:
            del manifest["integrity"]  # as a manifest written before the hash
        path.write_text(json.dumps(manifest))
    with live_server(store, dtype="float32", device="cpu") as url:
        ready = requests.get(f"{url}/readyz", timeout=10).json()
        assert "manifest.json was edited" in ready["errors"]["edited"], ready
        assert "the config gives conv_in.weight the shape" in ready["errors"]["wide"], ready
        (served,) = requests.get(f"{url}/models", timeout=10).json()["models"]
        assert served["name"] == "m" and served["source"] == "a"


def test_import_brings_the_encoder_the_family_finds_in_the_checkpoint(
    sources, tmp_path, stand_in_encoder
):
    from safetensors.torch import load_file

    from app.cli import main

    store = tmp_path / "store"
    argv = ["import", ENCODED, str(sources["a"]["path"]), "--name", "m", "--models-dir", str(store)]
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    manifest, tensors = load_encoder(store, "m", verify=True)
    assert set(manifest.parts) == {"decoder", "encoder"} and manifest.encoder_config["width"] == 32
    checkpoint = load_file(str(sources["a"]["path"] / "diffusion_pytorch_model.safetensors"))
    assert torch.equal(tensors["conv_in.weight"], checkpoint["encoder.conv_in.weight"])
    assert _served(store, sources) == "a"
