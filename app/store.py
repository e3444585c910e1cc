"""The model store: one folder per entry, published whole by one atomic pointer.

Layout (README, "Model store health")::

    DIR/NAME -> .entries/NAME@<version>      a relative symlink: the entry's one atomic pointer
    DIR/.entries/NAME@<version>/manifest.json, decoder.safetensors[, encoder.safetensors]
    DIR/.locks/NAME.lock                      flock: one writer per name at a time

A writer builds a new version folder completely (weights, manifest, fsynced), then swaps the
symlink with a rename: a crash at any point leaves the old entry or the new one, never a mix;
unpublished versions are removed by the next writer of that name. Stores of the older flat
layout (``DIR/NAME/manifest.json`` + ``decoder.safetensors``) load as they are, and the next
write upgrades them atomically. ``import`` converts a checkpoint once into canonical
safetensors; ``serve`` memory-maps them (nothing on the load path unpickles).

Links: the store follows one kind, its own entry link, and only to ``.entries/NAME@...`` (its
literal target is checked). Any other link below the root (``.entries``, a version folder, a
manifest or part file, ``.locks`` or a lock file) refuses the entry by name; part files are
plain names inside the entry. The root itself is the operator's path and may be a link.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from app.decoders import family_module
from app.decoders.base import VAEDecoder

MANIFEST = "manifest.json"
WEIGHTS = "decoder.safetensors"
PART_FILES = {"decoder": WEIGHTS, "encoder": "encoder.safetensors"}
ENTRIES, LOCKS = ".entries", ".locks"
VERSION_SEP = "@"  # never in a name, so "NAME@" prefixes only NAME's versions
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # fullmatch it: "$" passes "x\n"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Whoever serves a store may not be whoever wrote it (the image bakes as root and serves as an
# unprivileged user), and safetensors writes 0600: every entry is made world-readable.
READABLE_FILE, READABLE_DIR = 0o444, 0o555
# Test hook: the writer stops itself (SIGSTOP) at this named step, so a test can kill it there
# or let it go on (SIGCONT). Steps: locked, decoder, encoder, manifest, published.
PAUSE_ENV = "VAE_STORE_PAUSE_AT"


class StoreError(Exception):
    """A store entry that cannot be written or loaded; the message names it."""


def check_name(name: str) -> str:
    """Model names are plain identifiers: nothing that walks out of the store."""
    if not NAME_RE.fullmatch(name) or ".." in name:
        raise StoreError(f"invalid model name {name!r}: use letters, digits, '.', '_', '-'")
    return name


def entry_dir(store: Path, name: str) -> Path:
    """The folder holding one entry's current manifest and weights (its published version, or
    the flat folder of an older store). Files written there belong to that version: write them
    atomically (temporary name, then rename); a later import of the name replaces the folder.
    The entry link is followed only to this name's version in ``.entries``, itself no link."""
    link = Path(store) / check_name(name)
    if not link.is_symlink():
        return link  # the flat folder of an older store (or none: its manifest is missing)
    version = _version_of(name, os.readlink(link))
    entries = Path(store).resolve() / ENTRIES
    _refuse_link(entries, f"{name}: {ENTRIES}")
    _refuse_link(entries / version, f"{name}: its version folder {ENTRIES}/{version}")
    return entries / version


def _version_of(name: str, target: str) -> str:
    """The version an entry link names: its target must be literally ``.entries/NAME@...``
    (relative, one level down, this name's), so it cannot lead anywhere else."""
    folder, _, version = target.partition("/")
    if folder != ENTRIES or "/" in version or not version.startswith(name + VERSION_SEP):
        where = f"{ENTRIES}/{name}{VERSION_SEP}*"
        raise StoreError(f"{name}: entry link points outside {where}: {target!r}; refused")
    return version


# --- paths: nothing out of the store ---------------------------------------------------------

# Why descriptors for writes, lstat for reads: the lock file is created relative to a
# descriptor of ``.locks``, old versions are removed relative to one of ``.entries`` and modes
# are added through one of the path itself, each opened with O_NOFOLLOW (openat-style), so a
# link planted before or swapped in during a write is refused, never followed; new files go
# into the writer's own fresh version folder (mkdtemp, 0700). Reads check each path with lstat
# just before opening it (safetensors maps files by path): racing that check takes write
# access to the store while it loads, and whoever has that can serve any weights anyway.


def _refuse_link(path: Path, what: str) -> None:
    """``path`` must not be a link (a missing one is left to whoever opens it)."""
    if path.is_symlink():
        raise StoreError(f"{what} is a symlink; refused")


def _open_no_link(path: str | Path, flags: int, what: str, dir_fd: int | None = None) -> int:
    """``os.open`` refusing a link at ``path`` itself (StoreError), never following it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        mode = os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode
        kind = "a symlink" if stat.S_ISLNK(mode) else "not a folder"
        raise StoreError(f"{what} is {kind}; refused") from exc


@contextlib.contextmanager
def _folder(path: Path, what: str) -> Iterator[int]:
    """A descriptor of the real folder ``path`` (a link there is refused)."""
    fd = _open_no_link(path, os.O_RDONLY | os.O_DIRECTORY, what)
    try:
        yield fd
    finally:
        os.close(fd)


# --- manifest ------------------------------------------------------------------------------


@dataclass
class Manifest:
    name: str
    family: str
    config: dict[str, Any]
    dtype: str
    source: str
    sha256: str  # the decoder's weights (what manifests before ``parts`` held)
    created: str = ""
    # part -> {"file", "sha256"[, "config"]}; older manifests: the decoder only, from ``sha256``
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)
    integrity: str = ""  # sha256 of every other field: an edited manifest fails it

    def __post_init__(self) -> None:
        if not self.parts:
            self.parts = {"decoder": {"file": WEIGHTS, "sha256": self.sha256}}

    @property
    def encoder_config(self) -> dict[str, Any]:
        return self.parts.get("encoder", {}).get("config", self.config)

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        data = json.loads((folder / MANIFEST).read_text())
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def fields(self) -> dict[str, Any]:
        """The manifest as JSON holds it (lists, not tuples), without ``integrity``."""
        data = {k: v for k, v in self.__dict__.items() if k != "integrity"}
        return json.loads(json.dumps(data))

    def digest(self) -> str:
        canonical = json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def write(self, folder: Path) -> None:
        self.integrity = self.digest()
        text = json.dumps({**self.fields(), "integrity": self.integrity}, indent=2, sort_keys=True)
        _write_synced(folder / MANIFEST, (text + "\n").encode())


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


# --- config against weights, before anything is built ------------------------------------


def meta_module(build: Callable[[], nn.Module], what: str, tensors: int) -> nn.Module:
    """Build a module on the meta device: shapes only, no memory, however wide the config. A
    config that registers far more tensors than the weights hold (``tensors``: a layer count
    gone wrong) is stopped as it builds, before its modules cost minutes and gigabytes."""
    _count_registrations()
    _budget.left, _budget.what = 2 * tensors + 64, f"{what}: the weights hold {tensors} tensors"
    try:
        with torch.device("meta"):
            return build()
    except StoreError:
        raise
    except Exception as exc:
        raise StoreError(f"{what}: its config does not build: {exc}") from exc
    finally:
        _budget.left = None


_budget = threading.local()  # tensors a meta build in this thread may still register


@functools.cache
def _count_registrations() -> None:
    from torch.nn.modules import module as torch_module

    torch_module.register_module_parameter_registration_hook(_count_one)
    torch_module.register_module_buffer_registration_hook(_count_one)


def _count_one(module: nn.Module, name: str, value: Tensor | None) -> None:
    left = getattr(_budget, "left", None)
    if left is None or value is None:
        return
    if left <= 0:
        raise StoreError(f"{_budget.what}, its config builds far more; refused while building")
    _budget.left = left - 1


def read_header(what: str, path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype code) of a safetensors file, from its header alone."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {
                k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()
            }
    except Exception as exc:  # not a safetensors file: name the entry
        raise StoreError(f"{what}: cannot load: not a safetensors file ({exc})") from exc


def checked_meta_build(what: str, build: Callable[[], nn.Module], path: Path) -> nn.Module:
    """``build()`` on meta, checked against the weights file's header: every name and shape
    (the first mismatch is named, with the byte totals when the config builds more than the
    file holds). Nothing is allocated and only the header is read."""
    header = read_header(what, path)
    module = meta_module(build, what, len(header))
    need = sum(
        v.numel() * _dtype_bytes(header.get(k, ((), None))[1], v.element_size())
        for k, v in module.state_dict().items()
    )
    have = path.stat().st_size
    try:
        check_shapes(what, module, {k: shape for k, (shape, _) in header.items()})
    except StoreError as exc:
        if need <= have:
            raise
        size = f"{need / 1e6:.1f} MB of weights, {path.name} holds {have / 1e6:.1f} MB"
        raise StoreError(f"{exc} (the config builds {size})") from None
    return module


def check_shapes(what: str, module: nn.Module, shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse weights whose names or shapes differ from ``module``'s (built on meta)."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing, unexpected = sorted(expected.keys() - shapes), sorted(shapes.keys() - expected)
    if missing or unexpected:
        raise StoreError(
            f"{what}: weights do not fit the config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for key, shape in expected.items():
        if shapes[key] != shape:
            raise StoreError(
                f"{what}: the config gives {key} the shape {list(shape)}, the weights "
                f"{list(shapes[key])}"
            )


_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}


def _dtype_bytes(code: str | None, default: int) -> int:
    """Bytes per element of a header dtype code (``default``: the meta tensor's, for a name
    the file lacks or a code not listed)."""
    return _SAFETENSORS_BYTES.get(code or "", default)


def _encoder_builder(family: str) -> Callable[[dict[str, Any]], nn.Module] | None:
    """The family's encoder class when it has one (``app.encoders``), else None."""
    from app.encoders import encoder_module

    try:
        return encoder_module(family).Encoder
    except KeyError:
        return None


# --- writing ---------------------------------------------------------------------------------


@contextlib.contextmanager
def entry_lock(store: Path, name: str) -> Iterator[None]:
    """Hold the per-name write lock (``DIR/.locks/NAME.lock``); a second writer of the name
    waits for the first (and says so once), writers of other names do not."""
    fd = _open_lock(Path(store), check_name(name))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"store: waiting for another write of {name} to finish", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _open_lock(store: Path, name: str) -> int:
    """The name's lock file, opened or created relative to ``.locks``'s descriptor: a link at
    either is refused, so nothing outside the store is created or chmodded. Both are made
    readable by all: the whole store stays readable (scripts/build_image.sh)."""
    store.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        (store / LOCKS).mkdir()  # mkdir never follows a link: one there is refused below
    with _folder(store / LOCKS, f"{name}: lock folder {LOCKS}") as locks:
        what = f"{name}: lock file {LOCKS}/{name}.lock"
        fd = _open_no_link(f"{name}.lock", os.O_RDWR | os.O_CREAT, what, dir_fd=locks)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StoreError(f"{what} is not a regular file; refused")
            _add_mode_fd(fd, READABLE_FILE)
            _add_mode_fd(locks, READABLE_DIR)
        except BaseException:
            os.close(fd)
            raise
    return fd


def write_model(
    store: Path,
    name: str,
    family: str,
    config: dict[str, Any],
    state: dict[str, Tensor],
    source: str,
    dtype: str | None = None,
    encoder_state: dict[str, Tensor] | None = None,
    encoder_config: dict[str, Any] | None = None,
    extras: Callable[[Path, Manifest], None] | None = None,
) -> Manifest:
    """Write one entry as a whole (decoder, optional encoder, manifest) and publish it with one
    atomic rename, under the name's lock. The weights are checked against the family's modules
    (built on meta) before anything touches the disk. ``extras(folder, manifest)`` may add
    files to the unpublished version (gate references): they are published with it, or not
    at all when it raises."""
    store = Path(store)
    check_name(name)
    parts = {"decoder": state}
    build_decoder = lambda: family_module(family).Decoder(config)  # noqa: E731
    decoder = meta_module(build_decoder, f"{name}: decoder", len(state))
    check_shapes(f"{name}: decoder", decoder, _shapes(state))
    if encoder_state is not None:
        parts["encoder"] = encoder_state
        build = _encoder_builder(family)
        if build is not None:  # an encoder family to check against; else stored as given
            build_encoder = lambda: build(encoder_config or config)  # noqa: E731
            module = meta_module(build_encoder, f"{name}: encoder", len(encoder_state))
            check_shapes(f"{name}: encoder", module, _shapes(encoder_state))
    dtype = dtype or _dominant_dtype(state)
    store.mkdir(parents=True, exist_ok=True)
    with entry_lock(store, name):
        _pause("locked")
        entries = store / ENTRIES
        with contextlib.suppress(FileExistsError):
            entries.mkdir()  # never follows a link: one there is refused just below
        _refuse_link(entries, f"{name}: {ENTRIES}")
        _remove_versions(store, name)  # leftovers of a killed writer: never published
        version = Path(tempfile.mkdtemp(prefix=name + VERSION_SEP, dir=entries))
        try:
            described = _write_parts(version, parts, dtype)
            if encoder_config is not None:
                described["encoder"]["config"] = encoder_config
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            sha = described["decoder"]["sha256"]
            manifest = Manifest(name, family, config, dtype, source, sha, created, described)
            manifest.write(version)
            if extras is not None:
                extras(version, manifest)
            _seal(version, store)
        except BaseException:
            _remove(version)
            raise
        _pause("manifest")
        _publish(store, name, version)
        _pause("published")
        _remove_versions(store, name, keep=version.name)
    return manifest


def _write_parts(
    version: Path, parts: dict[str, dict[str, Tensor]], dtype: str
) -> dict[str, dict[str, Any]]:
    """Each part's safetensors in ``version``, fsynced; part -> {"file", "sha256"}."""
    described = {}
    for part, tensors in parts.items():
        path = version / PART_FILES[part]
        save_file(_cast(tensors, dtype), str(path))  # no metadata: its order is not stable
        _fsync(path)
        described[part] = {"file": path.name, "sha256": sha256_file(path)}
        _pause(part)
    return described


def _seal(version: Path, store: Path) -> None:
    """Make a written version readable by anyone and durable before anything names it."""
    for path in version.iterdir():
        _add_mode(path, READABLE_FILE)
    for folder in (version, version.parent, store.resolve()):  # the root may be a link
        _add_mode(folder, READABLE_DIR)
    _fsync(version)
    _fsync(version.parent)  # the version's own folder entry, before the link names it


def _publish(store: Path, name: str, version: Path) -> None:
    """Point ``DIR/NAME`` at ``version`` with one rename (an older flat folder is exchanged
    for the link atomically, then removed)."""
    link, target = store / name, f"{ENTRIES}/{version.name}"
    staged = store / ENTRIES / f"{name}{VERSION_SEP}link"
    if staged.is_symlink() or staged.exists():
        _remove(staged)
    os.symlink(target, staged)
    if link.is_dir() and not link.is_symlink():  # the flat layout: a real folder
        if not _exchange(staged, link):  # no renameat2: a short window without the entry
            os.rename(link, store / ENTRIES / f"{name}{VERSION_SEP}flat")
            os.replace(staged, link)
    else:
        os.replace(staged, link)
    _fsync(store)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _remove_versions(store: Path, name: str, keep: str = "") -> None:
    """Remove NAME's versions other than ``keep`` and the current one (only a writer holding
    the name's lock calls this, so none of them is being written)."""
    current = Path(os.readlink(store / name)).name if (store / name).is_symlink() else ""
    with _folder(store / ENTRIES, f"{name}: {ENTRIES}") as entries:
        for version in os.listdir(entries):
            if version.startswith(name + VERSION_SEP) and version not in (keep, current):
                _remove(version, entries)


def _remove(path: str | Path, dir_fd: int | None = None) -> None:
    """Unlink a file or a link; remove a real folder's tree (rmtree never descends a link)."""
    try:
        mode = os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True, dir_fd=dir_fd)
    else:
        os.unlink(path, dir_fd=dir_fd)


def _pause(step: str) -> None:
    if os.environ.get(PAUSE_ENV) == step:
        print(f"store: paused at {step} ({PAUSE_ENV})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _add_mode(path: Path, bits: int) -> None:
    """Add permission ``bits`` to ``path`` itself: a link there is refused, never chmodded
    through."""
    fd = _open_no_link(path, os.O_RDONLY, str(path))
    try:
        _add_mode_fd(fd, bits)
    finally:
        os.close(fd)


def _add_mode_fd(fd: int, bits: int) -> None:
    """Add permission ``bits`` (never remove any: the owner keeps write access)."""
    mode = os.fstat(fd).st_mode & 0o7777
    if mode | bits != mode:  # a file already readable by all may be another user's
        os.fchmod(fd, mode | bits)


def _shapes(state: dict[str, Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


def _cast(state: dict[str, Tensor], dtype: str) -> dict[str, Tensor]:
    return {
        k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).contiguous()
        for k, v in state.items()
    }


def _dominant_dtype(state: dict[str, Tensor]) -> str:
    counts: dict[str, int] = {}
    for v in state.values():
        if v.is_floating_point():
            name = str(v.dtype).removeprefix("torch.")
            counts[name] = counts.get(name, 0) + v.numel()
    best = max(counts, key=counts.get) if counts else "float32"
    return best if best in DTYPES else "float32"


# --- reading ---------------------------------------------------------------------------------


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
    _refuse_link(folder / MANIFEST, f"{name}: {MANIFEST}")
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
    _refuse_link(path, f"{name}: {path.name}")
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


def verify_entry(store: Path, name: str) -> Manifest:
    """Every part of an entry present and matching its hash; nothing is built."""
    folder, manifest = read_manifest(store, name)
    for part in manifest.parts:
        part_path(name, folder, manifest, part, verify=True)
    return manifest


def load_model(store: Path, name: str, verify: bool = False) -> tuple[Manifest, VAEDecoder]:
    """Memory-map one entry into its decoder (float32 CPU when the store holds float32). The
    config is checked against the weights file's header on the meta device first."""
    before = entry_dir(store, name)
    try:
        return _load_decoder(store, name, verify)
    except StoreError:
        if entry_dir(store, name) == before:
            raise
        return _load_decoder(store, name, verify)  # an import replaced the entry meanwhile


def _load_decoder(store: Path, name: str, verify: bool) -> tuple[Manifest, VAEDecoder]:
    folder, manifest = read_manifest(store, name)
    weights = part_path(name, folder, manifest, "decoder", verify)
    build = _decoder_class(name, manifest)
    meta = checked_meta_build(f"{name}: {WEIGHTS}", lambda: build(manifest.config), weights)
    try:
        state = load_file(str(weights))  # memory-mapped, no pickle
        decoder = _with_weights(meta, state) or _with_weights(build(manifest.config), state)
    except Exception as exc:  # a corrupt entry must name itself, not take the service down
        raise StoreError(f"{name}: cannot load {WEIGHTS}: {exc}") from exc
    return manifest, decoder.eval().requires_grad_(False)


def _with_weights(module: nn.Module, state: dict[str, Tensor]) -> Any:
    """``module`` holding ``state`` (assigned, not copied), or None when tensors the weights do
    not carry (buffers computed from the config) are left on the meta device: then the caller
    builds for real. The meta build skips the random init of every parameter."""
    module.load_state_dict(state, strict=True, assign=True)
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [v for m in module.modules() for v in vars(m).values() if isinstance(v, Tensor)]
    return None if any(t.is_meta for t in tensors) else module


def _decoder_class(name: str, manifest: Manifest) -> Callable[[dict[str, Any]], VAEDecoder]:
    try:
        return family_module(manifest.family).Decoder
    except KeyError as exc:
        raise StoreError(f"{name}: {exc.args[0]}") from exc


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
        build = _encoder_builder(manifest.family)
        if build is not None:
            config = manifest.encoder_config
            checked_meta_build(f"{name}: {path.name}", lambda: build(config), path)
        return manifest, load_file(str(path))
    except StoreError:
        raise
    except Exception as exc:
        raise StoreError(f"{name}: cannot load {path.name}: {exc}") from exc
