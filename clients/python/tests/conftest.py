"""Fixtures: the real service, from this repository's app/, on a loopback port.

The client needs no torch, but these tests drive the service in-process (tests/live.py), so
they run in the service's venv; tests/test_install.py checks the client in a torch-free one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SERVICE_ROOT = Path(__file__).resolve().parents[3]
if str(SERVICE_ROOT) not in sys.path:  # `pytest clients/python` from anywhere finds tests.live
    sys.path.insert(0, str(SERVICE_ROOT))

live = pytest.importorskip("tests.live", reason="the service's tests/live.py runs the server")


@pytest.fixture(scope="session")
def flux_store(tmp_path_factory) -> Path:
    """A tiny FLUX.1 decoder with seeded weights."""
    store = tmp_path_factory.mktemp("client-store")
    live.bake(store, "flux", "flux-tiny", live.TINY_FLUX["flux-tiny"])
    return store


@pytest.fixture(scope="session")
def live_server():
    """``live_server(store, **settings)``: a context manager serving ``store``, for tests that
    need a service configured their own way (a tiny queue, say)."""
    return live.live_server


@pytest.fixture(scope="session")
def flux_server(flux_store) -> Iterator[str]:
    """flux_store served float32 on loopback, flux-tiny the default model."""
    with live.live_server(flux_store, dtype="float32", default_model="flux-tiny") as url:
        yield url


@pytest.fixture(scope="module")
def video_server(tmp_path_factory) -> Iterator[str]:
    from app.families.minimax_h3 import decoder as minimax_h3

    store = tmp_path_factory.mktemp("video-store")
    live.bake(store, "minimax-h3", "video-tiny", minimax_h3.SYNTHETIC["minimax-h3-tiny"])
    with live.live_server(store, dtype="float32", default_model="video-tiny") as url:
        yield url
