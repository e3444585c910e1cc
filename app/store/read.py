"""Reading entries: the manifest's integrity, the parts' files and hashes, and the decoder and
encoder memory-mapped from them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from torch import Tensor, nn

from app.families.decoder import VAEDecoder
from app.store.files import (
    MANIFEST,
    NAME_RE,
    PART_FILES,
    StoreError,
    entry_dir,
    refuse_link,
)
from app.store.manifest import Manifest, sha256_file
from app.store.meta import checked_meta_build, part_class


def list_models(store: Path) -> list[str]:
    """Names of the entries that have a manifest (weights may still be missing)."""
    store = Path(store)
    if not store.is_dir():
        return []
    return sorted(
        p.name for p in store.iterdir() if NAME_RE.fullmatch(p.name) and (p / MANIFEST).is_file()
    )


def read_manifest(store: Path, name: str) -> tuple[Path, Manifest]:
    """An entry's folder and manifest, its integrity hash checked (manifests written before
    the hash existed have none to check)."""
    folder = entry_dir(store, name)
    refuse_link(folder / MANIFEST, f"{name}: {MANIFEST}")
    try:
        manifest = Manifest.read(folder)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise StoreError(f"{name}: unreadable manifest: {exc}") from exc
    if manifest.integrity and manifest.integrity != manifest.digest():
        raise StoreError(
            f"{name}: {MANIFEST} was edited after import (its integrity hash no longer matches "
            "its config, family, dtype and weights); import the model again"
        )
    return folder, manifest


def part_path(name: str, folder: Path, manifest: Manifest, part: str, verify: bool) -> Path:
    """One part's weights file, present and (``verify``) matching its sha256."""
    if part not in manifest.parts:
        held = ", ".join(manifest.parts)
        raise StoreError(
            f"{name} holds no {part} (its parts: {held}); import a checkpoint with one"
        )
    path = folder / _part_file(name, manifest, part)
    refuse_link(path, f"{name}: {path.name}")
    if not path.is_file():
        raise StoreError(f"{name}: {path.name} is missing (run `python -m app bake` or `import`)")
    if verify and sha256_file(path) != manifest.parts[part]["sha256"]:
        raise StoreError(f"{name}: {path.name} does not match the manifest's sha256")
    return path


def _part_file(name: str, manifest: Manifest, part: str) -> str:
    """A part's file name: a plain name inside the entry, a known part's canonical one."""
    spec = manifest.parts[part]
    file = spec.get("file") if isinstance(spec, dict) else None
    if not isinstance(file, str) or file in ("", ".", "..") or os.path.basename(file) != file:
        raise StoreError(f"{name}: manifest part file {file!r} is outside the entry; refused")
    if file != PART_FILES.get(part, file):
        raise StoreError(f"{name}: manifest part file {file!r} is not {PART_FILES[part]}")
    return file


def verify_part(store: Path, name: str, part: str) -> Manifest:
    """One part of an entry present and matching its hash; nothing is built."""
    folder, manifest = read_manifest(store, name)
    part_path(name, folder, manifest, part, verify=True)
    return manifest


def verify_entry(store: Path, name: str) -> Manifest:
    """Every part of an entry present and matching its hash; nothing is built."""
    folder, manifest = read_manifest(store, name)
    for part in manifest.parts:
        part_path(name, folder, manifest, part, verify=True)
    return manifest


def load_model(store: Path, name: str, verify: bool = False) -> tuple[Manifest, VAEDecoder]:
    """Memory-map one entry into its decoder (float32 CPU when the store holds float32)."""
    return load_part(store, name, "decoder", verify)


def load_part(store: Path, name: str, part: str, verify: bool = False) -> tuple[Manifest, Any]:
    """Memory-map one part of an entry (``decoder`` or ``encoder``) into its module. The
    config is checked against the weights file's header on the meta device first."""
    before = entry_dir(store, name)
    try:
        return _load_part(store, name, part, verify)
    except StoreError:
        if entry_dir(store, name) == before:
            raise
        return _load_part(store, name, part, verify)  # an import replaced the entry meanwhile


def _load_part(store: Path, name: str, part: str, verify: bool) -> tuple[Manifest, Any]:
    folder, manifest = read_manifest(store, name)
    weights = part_path(name, folder, manifest, part, verify)
    build = _part_class(name, manifest, part)
    config = manifest.config if part == "decoder" else manifest.encoder_config
    meta = checked_meta_build(f"{name}: {weights.name}", lambda: build(config), weights)
    try:
        state = load_file(str(weights))  # memory-mapped, no pickle
        module = _with_weights(meta, state) or _with_weights(build(config), state)
    except Exception as exc:  # a corrupt entry must name itself, not take the service down
        raise StoreError(f"{name}: cannot load {weights.name}: {exc}") from exc
    return manifest, module.eval().requires_grad_(False)


def _with_weights(module: nn.Module, state: dict[str, Tensor]) -> Any:
    """``module`` holding ``state`` (assigned, not copied), or None when tensors the weights do
    not carry (buffers computed from the config) are left on the meta device: then the caller
    builds for real. The meta build skips the random init of every parameter."""
    module.load_state_dict(state, strict=True, assign=True)
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [v for m in module.modules() for v in vars(m).values() if isinstance(v, Tensor)]
    return None if any(t.is_meta for t in tensors) else module


def _part_class(name: str, manifest: Manifest, part: str) -> Callable[[dict[str, Any]], Any]:
    try:
        build = part_class(manifest.family, part)
    except KeyError as exc:
        raise StoreError(f"{name}: {exc.args[0]}") from exc
    if build is None:
        raise StoreError(f"{name}: the {manifest.family} family has no {part}")
    return build


def load_encoder(
    store: Path, name: str, verify: bool = False
) -> tuple[Manifest, dict[str, Tensor]]:
    """Memory-map one entry's encoder tensors (checked against the family's encoder, built on
    meta, when the family has one). A decoder-only entry raises StoreError."""
    folder, manifest = read_manifest(store, name)
    if "encoder" not in manifest.parts:
        raise StoreError(
            f"{name} holds no encoder (a decoder-only entry): import a checkpoint that has one"
        )
    path = part_path(name, folder, manifest, "encoder", verify)
    try:
        build = part_class(manifest.family, "encoder")
        if build is not None:
            config = manifest.encoder_config
            checked_meta_build(f"{name}: {path.name}", lambda: build(config), path)
        return manifest, load_file(str(path))
    except StoreError:
        raise
    except Exception as exc:
        raise StoreError(f"{name}: cannot load {path.name}: {exc}") from exc
