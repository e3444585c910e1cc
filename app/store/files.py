"""The store's files: names, the one link it follows, durable writes and modes.

Every path the store opens, creates or chmods resolves inside the store root: reads check
for links just before opening (safetensors opens by path), writes go through ``O_NOFOLLOW``
descriptors.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

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
    version = version_of(name, os.readlink(link))
    entries = Path(store).resolve() / ENTRIES
    refuse_link(entries, f"{name}: {ENTRIES}")
    refuse_link(entries / version, f"{name}: its version folder {ENTRIES}/{version}")
    return entries / version


def version_of(name: str, target: str) -> str:
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


def refuse_link(path: Path, what: str) -> None:
    """``path`` must not be a link (a missing one is left to whoever opens it)."""
    if path.is_symlink():
        raise StoreError(f"{what} is a symlink; refused")


def open_no_link(path: str | Path, flags: int, what: str, dir_fd: int | None = None) -> int:
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
def open_folder(path: Path, what: str) -> Iterator[int]:
    """A descriptor of the real folder ``path`` (a link there is refused)."""
    fd = open_no_link(path, os.O_RDONLY | os.O_DIRECTORY, what)
    try:
        yield fd
    finally:
        os.close(fd)


def remove(path: str | Path, dir_fd: int | None = None) -> None:
    """Unlink a file or a link; remove a real folder's tree (rmtree never descends a link)."""
    try:
        mode = os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True, dir_fd=dir_fd)
    else:
        os.unlink(path, dir_fd=dir_fd)


def pause(step: str) -> None:
    if os.environ.get(PAUSE_ENV) == step:
        print(f"store: paused at {step} ({PAUSE_ENV})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def add_mode(path: Path, bits: int) -> None:
    """Add permission ``bits`` to ``path`` itself: a link there is refused, never chmodded
    through."""
    fd = open_no_link(path, os.O_RDONLY, str(path))
    try:
        add_mode_fd(fd, bits)
    finally:
        os.close(fd)


def add_mode_fd(fd: int, bits: int) -> None:
    """Add permission ``bits`` (never remove any: the owner keeps write access)."""
    mode = os.fstat(fd).st_mode & 0o7777
    if mode | bits != mode:  # a file already readable by all may be another user's
        os.fchmod(fd, mode | bits)
