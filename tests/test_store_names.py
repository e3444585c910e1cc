"""The store as the server sees it: broken entries named while the others serve, and model
names that cannot walk out of the store."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from app.config import Settings
from app.runtime import Runtime
from app.store import StoreError, check_name, load_model
from app.telemetry.metrics import Metrics
from tests import faulty
from tests.helpers import (
    client,
    faulty_family,
    faulty_server,
    faulty_store,
    post,
)
from tests.live import live_server

__all__ = ["faulty_family", "faulty_server", "faulty_store"]  # module-scoped fixtures


# --- broken stores -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broken_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("broken-store")
    for name in ("good", "truncated", "noweights", "badsha", "garbled"):
        faulty.bake(store, name)
    weights = lambda name: store / name / "decoder.safetensors"  # noqa: E731
    weights("truncated").write_bytes(weights("truncated").read_bytes()[:40])
    weights("noweights").unlink()
    data = bytearray(weights("badsha").read_bytes())
    data[-1] ^= 0x40  # still a valid safetensors file: only the hash can tell
    weights("badsha").write_bytes(bytes(data))
    (store / "garbled" / "manifest.json").write_text("{not json")
    return store


BROKEN = {
    "truncated": "sha256",
    "noweights": "missing",
    "badsha": "sha256",
    "garbled": "manifest",
    "absent": "manifest",
    "../etc": "invalid model name",
}


def test_broken_models_are_named_and_the_others_serve(broken_store):
    names = ",".join(["good", *BROKEN])
    with live_server(broken_store, dtype="float32", models=names) as url:
        ready = requests.get(f"{url}/readyz", timeout=10)
        assert ready.status_code == 503
        errors = ready.json()["errors"]
        for name, words in BROKEN.items():
            assert words in errors[name] and name in ready.json()["reason"], (name, errors)
        assert ready.json()["models"] == ["good"]
        assert post(url, faulty.latent(), model="good").status_code == 200
        r = post(url, faulty.latent(), model="truncated")
        assert r.status_code == 503 and "truncated" in r.json()["error"]


def test_without_hash_checks_corruption_is_still_named_and_ready_can_be_partial(broken_store):
    settings = dict(dtype="float32", ready_partial=True, verify_weights=False)
    runtime = Runtime(Settings(models_dir=broken_store, **settings), Metrics())
    runtime.load_all()
    assert runtime.ready and set(runtime.models) == {"good", "badsha"}
    assert set(runtime.errors) == {"truncated", "noweights", "garbled"}
    assert "cannot load" in runtime.errors["truncated"]


TRAVERSALS = [
    "/decode/..%2F..%2Fetc%2Fpasswd",
    "/decode/%2e%2e",
    "/decode/.env",
    "/decode/a%00b",
    "/decode/" + "a" * 80,
    "/decode?model=../../etc/passwd",
    "/decode?model=%2Fetc%2Fpasswd",
    "/decode?model=..",
]


@pytest.mark.parametrize("target", TRAVERSALS)
def test_model_names_cannot_walk_out_of_the_store(tmp_path, target):
    target += ("&" if "?" in target else "?") + "shape=[1,4,2,2]"
    r = client(tmp_path).post(target, content=b"\0" * 64)
    assert r.status_code == 404 and "error" in r.json(), r.text


@pytest.mark.parametrize("name", ["..", "../x", "a/b", "", ".x", "a" * 65, "a\0b", "a\\b"])
def test_the_store_refuses_names_that_are_not_plain(tmp_path, name):
    with pytest.raises(StoreError):
        check_name(name)
    with pytest.raises(StoreError):
        load_model(tmp_path, name)
