"""Shared fixtures: paths, small configs, and a live uvicorn server on loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

torch.set_num_threads(min(2, os.cpu_count() or 1))


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or skip: a user's clone has no ../shared."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent: ../shared ships only beside the project's CI checkout")
    return path


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module of tiny decodes (``usefixtures``): thread wake-ups, not
    FLOPs, dominate with more. A live server runs in the test process, so its worker too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def flux_store(tmp_path_factory) -> Path:
    """Tiny FLUX.1 / SD / FLUX.2 decoders with seeded weights."""
    from tests.live import TINY_FLUX, bake

    store = tmp_path_factory.mktemp("store")
    for name, config in TINY_FLUX.items():
        bake(store, "flux", name, config)
    return store


@pytest.fixture(scope="session")
def flux_server(flux_store):
    from tests.live import live_server

    with live_server(flux_store, dtype="float32", default_model="flux-tiny") as url:
        yield url
