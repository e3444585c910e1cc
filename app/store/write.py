"""Writing an entry: every part and the manifest into a new version folder, published by one
atomic rename under the name's lock."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from app.store.files import (
    DTYPES,
    ENTRIES,
    LOCKS,
    PART_FILES,
    READABLE_DIR,
    READABLE_FILE,
    VERSION_SEP,
    StoreError,
    add_mode,
    add_mode_fd,
    check_name,
    fsync_path,
    open_folder,
    open_no_link,
    pause,
    refuse_link,
    remove,
)
from app.store.manifest import Manifest, sha256_file
from app.store.meta import check_pair, check_shapes, meta_module, part_class


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
    with open_folder(store / LOCKS, f"{name}: lock folder {LOCKS}") as locks:
        what = f"{name}: lock file {LOCKS}/{name}.lock"
        fd = open_no_link(f"{name}.lock", os.O_RDWR | os.O_CREAT, what, dir_fd=locks)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StoreError(f"{what} is not a regular file; refused")
            add_mode_fd(fd, READABLE_FILE)
            add_mode_fd(locks, READABLE_DIR)
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
    build_decoder = lambda: _decoder_class(name, family)(config)  # noqa: E731
    decoder = meta_module(build_decoder, f"{name}: decoder", len(state))
    check_shapes(f"{name}: decoder", decoder, _shapes(state))
    if encoder_state is not None:
        parts["encoder"] = encoder_state
        build = part_class(family, "encoder")
        if build is not None:  # an encoder family to check against; else stored as given
            build_encoder = lambda: build(encoder_config or config)  # noqa: E731
            module = meta_module(build_encoder, f"{name}: encoder", len(encoder_state))
            check_shapes(f"{name}: encoder", module, _shapes(encoder_state))
            check_pair(name, decoder, module)
    dtype = dtype or _dominant_dtype(state)
    store.mkdir(parents=True, exist_ok=True)
    with entry_lock(store, name):
        pause("locked")
        entries = store / ENTRIES
        with contextlib.suppress(FileExistsError):
            entries.mkdir()  # never follows a link: one there is refused just below
        refuse_link(entries, f"{name}: {ENTRIES}")
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
            remove(version)
            raise
        pause("manifest")
        _publish(store, name, version)
        pause("published")
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
        fsync_path(path)
        described[part] = {"file": path.name, "sha256": sha256_file(path)}
        pause(part)
    return described


def _seal(version: Path, store: Path) -> None:
    """Make a written version readable by anyone and durable before anything names it."""
    for path in version.iterdir():
        add_mode(path, READABLE_FILE)
    for folder in (version, version.parent, store.resolve()):  # the root may be a link
        add_mode(folder, READABLE_DIR)
    fsync_path(version)
    fsync_path(version.parent)  # the version's own folder entry, before the link names it


def _publish(store: Path, name: str, version: Path) -> None:
    """Point ``DIR/NAME`` at ``version`` with one rename (an older flat folder is exchanged
    for the link atomically, then removed)."""
    link, target = store / name, f"{ENTRIES}/{version.name}"
    staged = store / ENTRIES / f"{name}{VERSION_SEP}link"
    if staged.is_symlink() or staged.exists():
        remove(staged)
    os.symlink(target, staged)
    if link.is_dir() and not link.is_symlink():  # the flat layout: a real folder
        if not _exchange(staged, link):  # no renameat2: a short window without the entry
            os.rename(link, store / ENTRIES / f"{name}{VERSION_SEP}flat")
            os.replace(staged, link)
    else:
        os.replace(staged, link)
    fsync_path(store)


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
    with open_folder(store / ENTRIES, f"{name}: {ENTRIES}") as entries:
        for version in os.listdir(entries):
            if version.startswith(name + VERSION_SEP) and version not in (keep, current):
                remove(version, entries)


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


def _decoder_class(name: str, family: str) -> Callable[[dict[str, Any]], Any]:
    try:
        return part_class(family, "decoder")
    except KeyError as exc:
        raise StoreError(f"{name}: {exc.args[0]}") from exc
