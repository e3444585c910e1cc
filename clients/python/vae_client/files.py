"""Output files: written beside the target and renamed, so a failed call leaves none."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import numpy as np


@contextmanager
def atomic_write(path: Path) -> Iterator[IO[bytes]]:
    """Write beside ``path`` and rename on success: no half-written output files."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
    try:
        with tmp.open("wb") as f:
            yield f
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def save_array(path: Path, array: np.ndarray) -> None:
    with atomic_write(path) as f:
        np.save(f, array)
