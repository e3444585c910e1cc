"""Gate references: the float32 CPU reference's outputs on the parity gate's probes, computed
once when a model enters the store (``bake``, ``import``) and kept beside its weights, so a
start decodes the probes only on the candidate paths.

The file (``gate_reference.safetensors`` in the entry's folder) holds one tensor per check
(``plain``, ``denormalized``, ``tiled``) and two metadata strings: ``key``, the JSON of
everything that determines the outputs (the weights' sha256, a fingerprint of the family's
exact-path source code, the torch version, the probe spec), and ``sha256``, the digest of the
tensors. A start with another key recomputes the reference (stale); a digest that does not
match the tensors is a tampered or corrupt file: it is never used, the reference is recomputed.
Either way the fresh reference is written back when the store is writable.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file
from torch import Tensor

import app.decoders
from app.decoders import family_module
from app.runtime import gate
from app.store import Manifest, entry_dir, load_model

log = logging.getLogger("app.runtime.references")

REFERENCE_FILE = "gate_reference.safetensors"
# shared code every family's exact path runs through (the family's own package is added)
SHARED_SOURCES = ("base.py", "ops.py", "tiling.py")


def code_fingerprint(family: str) -> str:
    """sha256 of the source files the family's exact path is made of, and of the gate's (which
    makes the reference's calls)."""
    root = Path(app.decoders.__file__).parent
    module = Path(family_module(family).__file__)
    own = sorted(module.parent.rglob("*.py")) if module.name == "__init__.py" else [module]
    files = [root / name for name in SHARED_SOURCES] + own + [Path(gate.__file__)]  # + the calls
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def reference_key(manifest: Manifest, probes: gate.Probes) -> dict[str, Any]:
    return {
        "weights_sha256": manifest.sha256,
        "code": code_fingerprint(manifest.family),
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


def read(folder: Path, key: dict[str, Any]) -> tuple[dict[str, Tensor] | None, str]:
    """(tensors, "valid") or (None, why not: "missing", "stale", "tampered")."""
    path = Path(folder) / REFERENCE_FILE
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


def write(folder: Path, key: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    """Atomically (tmp + os.replace) write the reference beside the weights."""
    folder = Path(folder)
    tensors = {name: t.detach().float().cpu().contiguous().clone() for name, t in tensors.items()}
    meta = {"key": _canonical(key), "sha256": tensors_digest(tensors)}
    tmp = folder / f".{REFERENCE_FILE}.{os.getpid()}.tmp"
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.chmod(tmp, 0o444)  # served by another user than the baker's (app/store/__init__.py)
        os.replace(tmp, folder / REFERENCE_FILE)
    finally:
        tmp.unlink(missing_ok=True)


def probes_for(folder: Path, manifest: Manifest, probes: gate.Probes) -> str:
    """Fill ``probes`` with the stored reference outputs, or recompute them (and write them
    back where the store is writable). Returns what was found: valid, missing, stale, tampered."""
    tensors, status = read(folder, reference_key(manifest, probes))
    if tensors is not None and set(tensors) == set(probes.check_names()):
        probes.set_expected(tensors)
        return status
    return recompute(folder, manifest, probes, "stale" if status == "valid" else status)


def recompute(folder: Path, manifest: Manifest, probes: gate.Probes, status: str) -> str:
    """The reference decodes the probes; the result is written back where the store is
    writable. ``status`` (why: missing, stale, tampered) is logged and returned."""
    level = logging.ERROR if status == "tampered" else logging.INFO
    log.log(level, "model %s: gate reference %s: recomputing it", manifest.name, status)
    probes.set_expected({})  # never a tensor of a reference that failed its check
    expected = probes.all_expected()
    try:
        write(folder, reference_key(manifest, probes), expected)
        log.info("model %s: gate reference written to %s", manifest.name, folder)
    # a read-only store, or a version a later import replaced meanwhile (safetensors reports
    # the vanished folder as its own error): the reference lives for this process only
    except (OSError, SafetensorError) as exc:
        log.warning("model %s: gate reference not written (%s)", manifest.name, exc)
    return status


def store_reference(store: Path, name: str) -> str:
    """Compute and store one entry's gate reference (``bake``/``import`` call it)."""
    manifest, decoder = load_model(store, name)
    decoder = decoder.float()
    return probes_for(entry_dir(store, name), manifest, gate.Probes(decoder))


def _canonical(key: dict[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))
