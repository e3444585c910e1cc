"""The store follows no link out of itself (issue 35): a planted lock file or folder changes and
creates nothing outside it; a manifest's part file, an entry link, ``.entries``, a version
folder or a weights file that leads elsewhere refuses the entry by name while the others serve."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import requests
import torch

from app.runtime import references
from app.store import ENTRIES, Manifest, StoreError, entry_dir, load_model, verify_entry
from tests import faulty
from tests.helpers import faulty_family, post
from tests.live import live_server

__all__ = ["faulty_family"]  # the module-scoped fixture that registers the faulty family


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every path under ``folder``: its mode and (files) content."""
    return {
        str(p.relative_to(folder)): (p.lstat().st_mode, p.read_bytes() if p.is_file() else b"")
        for p in sorted(folder.rglob("*"))
    }


def _outside(tmp_path: Path) -> Path:
    """A folder beside the store with a private file and a folder named like a version."""
    outside = tmp_path / "outside"
    (outside / "m@old").mkdir(parents=True)
    (outside / "m@old" / "keep").write_text("keep")
    (outside / "secret").write_text("secret")
    (outside / "secret").chmod(0o600)
    return outside


# --- writing: nothing outside the store is created, chmodded or removed ----------------------

PLANTED = {  # what is a link, to where under ``outside``, and what the refusal says
    "lock-file": (".locks/m.lock", "secret", "lock file .locks/m.lock is a symlink"),
    "dangling-lock-file": (".locks/m.lock", "created", "lock file .locks/m.lock is a symlink"),
    "lock-folder": (".locks", ".", "lock folder .locks is a symlink"),
    "entries": (ENTRIES, ".", f"{ENTRIES} is a symlink"),
}


@pytest.mark.parametrize("planted", PLANTED)
def test_a_write_through_a_planted_link_changes_nothing_outside(planted, tmp_path):
    store, outside = tmp_path / "store", _outside(tmp_path)
    at, target, refusal = PLANTED[planted]
    (store / at).parent.mkdir(parents=True, exist_ok=True)
    (store / at).symlink_to(outside / target)
    before = _snapshot(outside)
    with pytest.raises(StoreError, match=f"^m: {refusal}"):
        faulty.bake(store, "m")
    assert _snapshot(outside) == before  # no mode added, no file made, no folder removed
    assert not (store / "m").exists()


def test_the_store_root_may_be_a_link(tmp_path):
    """The root is the operator's path: only what lies below it must not be a link."""
    (tmp_path / "real").mkdir()
    (tmp_path / "store").symlink_to(tmp_path / "real")
    faulty.bake(tmp_path / "store", "m")
    faulty.bake(tmp_path / "store", "m")  # a second write replaces the first
    verify_entry(tmp_path / "store", "m")
    assert len(list((tmp_path / "real" / ENTRIES).iterdir())) == 1


# --- reading: an entry that leads out of the store is refused by name ------------------------


def _rewrite(store: Path, name: str, edit) -> None:
    """Edit an entry's manifest and recompute its (unkeyed) integrity hash, as an attacker
    can."""
    folder = entry_dir(store, name)
    manifest = Manifest.read(folder)
    edit(manifest, folder)
    (folder / "manifest.json").unlink()  # 0444: replaced, not written over
    manifest.write(folder)


def _part_file(file: str):
    """An edit pointing the decoder at ``file``, with the entry's own weights copied there:
    the old store served them, the hash matching."""

    def edit(manifest: Manifest, folder: Path) -> None:
        target = (folder / file).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(folder / "decoder.safetensors", target)
        manifest.parts["decoder"]["file"] = file

    return edit


def _copy_entry(store: Path, name: str, to: Path) -> Path:
    """A valid copy of an entry's version folder at ``to``."""
    shutil.copytree(entry_dir(store, name), to)
    return to


@pytest.fixture(scope="module")
def links_store(tmp_path_factory) -> Path:
    """One good entry and one of each way out of the store (``REFUSED``)."""
    root = tmp_path_factory.mktemp("links")
    store = root / "store"
    for name in ("good", "climbs", "absolute", "linked-part", "linked-manifest", "away"):
        faulty.bake(store, name)
    _rewrite(store, "climbs", _part_file("../../../outside.safetensors"))
    _rewrite(store, "absolute", _part_file(str(root / "abs" / "decoder.safetensors")))
    for name, file in (
        ("linked-part", "decoder.safetensors"),
        ("linked-manifest", "manifest.json"),
    ):
        path = entry_dir(store, name) / file
        shutil.copy(path, root / f"{name}-{file}")
        path.unlink()
        path.symlink_to(root / f"{name}-{file}")
    (store / "away").unlink()
    (store / "away").symlink_to(_copy_entry(store, "good", root / "away"))
    (store / "other").symlink_to(f"{ENTRIES}/{entry_dir(store, 'good').name}")
    (store / "absolute-link").symlink_to(entry_dir(store, "good"))
    version = _copy_entry(store, "good", root / "linked-version")
    (store / ENTRIES / "linked-version@x").symlink_to(version)
    (store / "linked-version").symlink_to(f"{ENTRIES}/linked-version@x")
    return store


REFUSED = {
    "climbs": "manifest part file '../../../outside.safetensors' is outside the entry",
    "absolute": "manifest part file '/",
    "linked-part": "decoder.safetensors is a symlink",
    "linked-manifest": "manifest.json is a symlink",
    "away": "entry link points outside .entries/away@*",
    "other": "entry link points outside .entries/other@*",
    "absolute-link": "entry link points outside .entries/absolute-link@*",
    "linked-version": "its version folder .entries/linked-version@x is a symlink",
}


@pytest.mark.parametrize("name", REFUSED)
def test_an_entry_leading_out_of_the_store_is_refused_by_name(name, links_store):
    for load in (load_model, verify_entry):
        with pytest.raises(StoreError, match=f"^{name}: ") as refused:
            load(links_store, name)
        assert REFUSED[name] in str(refused.value)


def test_a_linked_entries_folder_is_refused(tmp_path):
    store = tmp_path / "store"
    faulty.bake(store, "m")
    (store / ENTRIES).rename(tmp_path / "elsewhere")
    (store / ENTRIES).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StoreError, match=f"^m: {ENTRIES} is a symlink"):
        load_model(store, "m")


def test_the_server_names_each_refused_entry_and_serves_the_good_one(links_store):
    with live_server(links_store, dtype="float32", device="cpu") as url:
        ready = requests.get(f"{url}/readyz", timeout=10).json()
        for name, words in REFUSED.items():
            assert words in ready["errors"][name], (name, ready["errors"])
        models = requests.get(f"{url}/models", timeout=10).json()["models"]
        assert [m["name"] for m in models] == ["good"]
        assert post(url, faulty.latent(), model="good").status_code == 200


# --- the gate reference beside the weights ---------------------------------------------------

KEY = {"weights_sha256": "test"}


def test_a_linked_gate_reference_is_not_read(tmp_path):
    store = tmp_path / "store"
    faulty.bake(store, "m")
    folder = entry_dir(store, "m")
    references.write(folder, KEY, {"plain": torch.ones(2)})
    assert references.read(folder, KEY)[1] == "valid"
    path = folder / references.REFERENCE_FILE
    path.rename(tmp_path / "reference.safetensors")
    path.symlink_to(tmp_path / "reference.safetensors")
    assert references.read(folder, KEY) == (None, "tampered")
