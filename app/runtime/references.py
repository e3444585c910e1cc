"""Gate references: the exact path's outputs on the parity gate's probes, computed once when
a model enters the store (``bake``, ``import``) and kept beside its weights, so a start runs
the probes only on the candidate paths. One file per part: the decoder's and the encoder's.

The file (``gate_reference.safetensors``, the encoder's ``encoder_gate_reference.safetensors``,
in the entry's folder) holds one tensor per check (a decoder's ``plain``, ``denormalized``,
``tiled``; an encoder's ``plain``, ``second``) and two metadata strings: ``key``, the JSON of
everything that determines the outputs (the part's weights sha256, a fingerprint of the
family's exact-path source code, the torch version, the probe spec), and ``sha256``, the digest
of the tensors. A start with another key recomputes the reference (stale); a digest that does
not match the tensors is a tampered or corrupt file: it is never used, the reference is
recomputed. Either way the fresh reference is written back when the store is writable.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file
from torch import Tensor

import app.families
from app.families import family
from app.runtime import gate
from app.store import Manifest, entry_dir, load_part, read_manifest

log = logging.getLogger("app.runtime.references")

REFERENCE_FILES = {"decoder": "gate_reference.safetensors",
                   "encoder": "encoder_gate_reference.safetensors"}  # fmt: skip
REFERENCE_FILE = REFERENCE_FILES["decoder"]
# shared code every family's exact path runs through (the part's own package is added)
SHARED_SOURCES = {
    "decoder": ("decoder.py", "ops.py", "tiling.py"),
    "encoder": ("encoder.py", "encoding.py", "attention.py", "ops.py", "tiling.py"),
}


def code_fingerprint(family_key: str, part: str = "decoder") -> str:
    """sha256 of the source files the part's exact path is made of (its package, the shared
    modules), and of the gate's (which makes the reference's calls)."""
    root = Path(app.families.__file__).parent
    module = Path(inspect.getfile(getattr(family(family_key), part).module))
    own = sorted(module.parent.rglob("*.py")) if module.parent.parent.parent == root else [module]
    shared = [root / name for name in SHARED_SOURCES[part]]
    digest = hashlib.sha256()
    for path in [*shared, *own, Path(gate.__file__)]:  # + the calls
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def reference_key(manifest: Manifest, probes: gate.Probes, part: str = "decoder") -> dict[str, Any]:
    return {
        "weights_sha256": manifest.parts[part]["sha256"],
        "code": code_fingerprint(manifest.family, part),
        "torch": torch.__version__,
        "probe": probes.spec(),
    }


def tensors_digest(tensors: dict[str, Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}:{t.dtype}:{list(t.shape)}\0".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def read(
    folder: Path, key: dict[str, Any], part: str = "decoder"
) -> tuple[dict[str, Tensor] | None, str]:
    """(tensors, "valid") or (None, why not: "missing", "stale", "tampered")."""
    path = Path(folder) / REFERENCE_FILES[part]
    if path.is_symlink():  # the store follows no link but its entry's (app/store/__init__.py)
        log.error("gate reference %s is a symlink: not read", path)
        return None, "tampered"
    if not path.is_file():
        return None, "missing"
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (OSError, SafetensorError, ValueError) as exc:
        log.error("gate reference %s is unreadable: %s", path, exc)
        return None, "tampered"
    if meta.get("key") != _canonical(key):
        return None, "stale"
    if meta.get("sha256") != tensors_digest(tensors):
        return None, "tampered"
    return tensors, "valid"


def write(
    folder: Path, key: dict[str, Any], tensors: dict[str, Tensor], part: str = "decoder"
) -> None:
    """Atomically (tmp + os.replace) write the reference beside the weights."""
    folder = Path(folder)
    tensors = {name: t.detach().float().cpu().contiguous().clone() for name, t in tensors.items()}
    meta = {"key": _canonical(key), "sha256": tensors_digest(tensors)}
    tmp = folder / f".{REFERENCE_FILES[part]}.{os.getpid()}.tmp"
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.chmod(tmp, 0o444)  # served by another user than the baker's (app/store/__init__.py)
        os.replace(tmp, folder / REFERENCE_FILES[part])
    finally:
        tmp.unlink(missing_ok=True)


def load(
    store: Path, name: str, part: str, manifest: Manifest, probes: gate.Probes
) -> tuple[Path, str]:
    """The entry's folder, and the stored reference of ``part`` set on ``probes`` where it is
    valid; the status: valid, missing, stale (made by other code or probes), tampered."""
    folder = entry_dir(store, name)
    tensors, status = read(folder, reference_key(manifest, probes, part), part)
    if tensors is not None and set(tensors) == set(probes.check_names()):
        probes.set_expected(tensors)
    elif status == "valid":
        status = "stale"  # the gate's checks changed
    return folder, status


def recompute(
    folder: Path, manifest: Manifest, part: str, probes: gate.Probes, status: str
) -> None:
    """The exact path runs the probes; the result is written back where the store is
    writable. ``status`` (why: missing, stale, tampered) is logged."""
    log.log(
        _level(status),
        "model %s: %s gate reference %s: recomputing it",
        manifest.name,
        part,
        status,
    )
    probes.set_expected({})  # never a tensor of a reference that failed its check
    expected = probes.all_expected()
    try:
        write(folder, reference_key(manifest, probes, part), expected, part)
        log.info("model %s: %s gate reference written to %s", manifest.name, part, folder)
    # a read-only store, or a version a later import replaced meanwhile (safetensors reports
    # the vanished folder as its own error): the reference lives for this process only
    except (OSError, SafetensorError) as exc:
        log.warning("model %s: %s gate reference not written (%s)", manifest.name, part, exc)


def store_references(store: Path, name: str) -> str:
    """Compute and store the gate reference of each part of one entry (``bake`` and
    ``import`` call it); what it did, for their output line."""
    _, manifest = read_manifest(store, name)
    done = []
    for part in manifest.parts:
        _, module = load_part(store, name, part)
        probes = gate.probes_for(module.float())
        folder, status = load(store, name, part, manifest, probes)
        if status != "valid":
            recompute(folder, manifest, part, probes, status)
        done.append(f"{part} {'kept' if status == 'valid' else 'stored'}")
    return "gate references: " + ", ".join(done)


def _level(status: str) -> int:
    return logging.ERROR if status == "tampered" else logging.INFO


def _canonical(key: dict[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))
