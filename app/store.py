"""The model store: ``DIR/NAME/manifest.json`` + ``DIR/NAME/decoder.safetensors``.

``import`` converts a checkpoint once into canonical decoder-only safetensors; ``serve``
memory-maps them (safetensors only: nothing on the load path unpickles).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from app.decoders import family_module
from app.decoders.base import VAEDecoder

MANIFEST = "manifest.json"
WEIGHTS = "decoder.safetensors"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # fullmatch it: "$" passes "x\n"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Whoever serves a store may not be whoever wrote it (the image bakes as root and serves as an
# unprivileged user), and safetensors writes 0600: every entry is made world-readable.
READABLE_FILE, READABLE_DIR = 0o444, 0o555


class StoreError(Exception):
    """A store entry that cannot be written or loaded; the message names it."""


def check_name(name: str) -> str:
    """Model names are plain identifiers: nothing that walks out of the store."""
    if not NAME_RE.fullmatch(name) or ".." in name:
        raise StoreError(f"invalid model name {name!r}: use letters, digits, '.', '_', '-'")
    return name


def entry_dir(store: Path, name: str) -> Path:
    """The folder that holds one entry's current files (manifest, weights, gate references)."""
    return Path(store) / check_name(name)


@dataclass
class Manifest:
    name: str
    family: str
    config: dict[str, Any]
    dtype: str
    source: str
    sha256: str
    created: str = ""

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        data = json.loads((folder / MANIFEST).read_text())
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def write(self, folder: Path) -> None:
        text = json.dumps(self.__dict__, indent=2, sort_keys=True) + "\n"
        (folder / MANIFEST).write_text(text)


def public_source(source: str) -> str:
    """What ``/models`` shows of where a model came from: a path's last part (the host's
    folders are nobody's business), other labels (``synthetic:seed=0``) as they are."""
    if "/" in source or "\\" in source:
        return re.split(r"[/\\]", source.rstrip("/\\"))[-1] or "-"
    return source


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_model(
    store: Path,
    name: str,
    family: str,
    config: dict[str, Any],
    state: dict[str, Tensor],
    source: str,
    dtype: str | None = None,
) -> Manifest:
    """Write one entry: weights checked against the family's decoder, then the manifest."""
    folder = Path(store) / check_name(name)
    decoder = family_module(family).Decoder(config)
    missing, unexpected = _compare_keys(decoder, state)
    if missing or unexpected:
        raise StoreError(
            f"{name}: weights do not fit the {family} decoder: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}"
        )
    dtype = dtype or _dominant_dtype(state)
    cast = {
        k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).contiguous()
        for k, v in state.items()
    }
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (WEIGHTS + ".tmp")
    save_file(cast, str(tmp))  # no metadata: its order is not stable, and sha256 must be
    _add_mode(tmp, READABLE_FILE)
    tmp.replace(folder / WEIGHTS)
    manifest = Manifest(
        name,
        family,
        config,
        dtype,
        source,
        sha256_file(folder / WEIGHTS),
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    manifest.write(folder)
    for path, mode in ((folder / MANIFEST, READABLE_FILE), (folder, READABLE_DIR)):
        _add_mode(path, mode)
    _add_mode(Path(store), READABLE_DIR)
    return manifest


def _add_mode(path: Path, bits: int) -> None:
    """Add permission ``bits`` (never remove any: the owner keeps write access)."""
    os.chmod(path, os.stat(path).st_mode & 0o7777 | bits)


def _compare_keys(decoder: VAEDecoder, state: dict[str, Tensor]) -> tuple[list[str], list[str]]:
    expected = set(decoder.state_dict())
    return sorted(expected - set(state)), sorted(set(state) - expected)


def _dominant_dtype(state: dict[str, Tensor]) -> str:
    counts: dict[str, int] = {}
    for v in state.values():
        if v.is_floating_point():
            name = str(v.dtype).removeprefix("torch.")
            counts[name] = counts.get(name, 0) + v.numel()
    best = max(counts, key=counts.get) if counts else "float32"
    return best if best in DTYPES else "float32"


def list_models(store: Path) -> list[str]:
    """Names of the entries that have a manifest (weights may still be missing)."""
    store = Path(store)
    if not store.is_dir():
        return []
    return sorted(p.name for p in store.iterdir() if (p / MANIFEST).is_file())


def load_model(store: Path, name: str, verify: bool = False) -> tuple[Manifest, VAEDecoder]:
    """Memory-map one entry into its decoder (float32 CPU when the store holds float32)."""
    folder = Path(store) / check_name(name)
    try:
        manifest = Manifest.read(folder)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise StoreError(f"{name}: unreadable manifest: {exc}") from exc
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise StoreError(f"{name}: {WEIGHTS} is missing (run `python -m app bake` or `import`)")
    if verify and sha256_file(weights) != manifest.sha256:
        raise StoreError(f"{name}: {WEIGHTS} does not match the manifest's sha256")
    try:
        state = load_file(str(weights))  # memory-mapped, no pickle
        decoder = family_module(manifest.family).Decoder(manifest.config)
        decoder.load_state_dict(state, strict=True, assign=True)
    except Exception as exc:  # a corrupt entry must name itself, not take the service down
        raise StoreError(f"{name}: cannot load {WEIGHTS}: {exc}") from exc
    return manifest, decoder.eval().requires_grad_(False)
