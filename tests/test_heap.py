"""``VAE_HEAP_REUSE``: a decode's maps come from memory its earlier ops freed, not fresh pages
the kernel faults in and zeroes; once the worker is idle the heap's free pages go back to
the OS. Measured on a real ``python -m app serve`` process: its minor page faults over one
decode, and its resident set before and after the idle release (app/runtime/heap.py)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import requests

from app.runtime import heap
from tests.faulty import rss_bytes, serve_process

pytestmark = pytest.mark.skipif(not heap.available(), reason="glibc's allocator only")

# flux-tiny's exact path at 768x768: its full-size maps are 16 channels of float32, 36 MiB
# each, past glibc's largest mmap threshold (32 MiB)
SHAPE = (1, 16, 96, 96)
MAP_BYTES = 16 * 768 * 768 * 4
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# with transparent huge pages always on, a fresh map faults in 2 MiB at a time: the counts of
# the two heaps are then not comparable (the idle release still is)
HUGE_PAGES_ALWAYS = THP.exists() and "[always]" in THP.read_text()


def minor_faults(pid: int) -> int:
    """The process's minor page faults so far (proc(5): the 10th field of /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[7])


def _decode(url: str) -> None:
    z = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    r = requests.post(
        f"{url}/decode/flux-tiny",
        params={"shape": list(SHAPE), "dtype": "float32", "output_type": "pt"},
        data=z.tobytes(),
        headers={"Content-Type": "tensor/binary"},
        timeout=120,
    )
    assert r.status_code == 200, r.text


def _faults_of_a_decode(url: str, pid: int, decodes: int = 1) -> int:
    """The fewest page faults of one decode over ``decodes`` decodes after the first (which
    grows the heap)."""
    _decode(url)
    faults = []
    for _ in range(decodes):
        before = minor_faults(pid)
        _decode(url)
        faults.append(minor_faults(pid) - before)
    return min(faults)


def test_a_reused_heap_faults_no_map_in_and_gives_its_pages_back_when_idle(flux_store, tmp_path):
    # The reused heap's steady state: its one arena also serves the server's other threads
    # (bodies, answers), so the second decode alone sometimes still grows it (measured: up to
    # 47k pages, once failing CI; the third and fourth 8 to 9k; glibc's defaults 360k each).
    # The idle time is well past the gap between two requests on a loaded machine.
    env = {"VAE_MODELS": "flux-tiny", "VAE_HEAP_IDLE_S": "8"}
    with serve_process(flux_store, tmp_path / "glibc.log", **env) as (url, proc):
        glibc = _faults_of_a_decode(url, proc.pid)
    env["VAE_HEAP_REUSE"] = "1"
    with serve_process(flux_store, tmp_path / "reuse.log", **env) as (url, proc):
        reused = _faults_of_a_decode(url, proc.pid, decodes=3)
        busy = rss_bytes(proc.pid)
        time.sleep(10)  # the worker idles past VAE_HEAP_IDLE_S
        idle = rss_bytes(proc.pid)
    if not HUGE_PAGES_ALWAYS:
        assert glibc > 4 * MAP_BYTES >> 12, f"glibc's defaults faulted {glibc} pages in"
        # what is left: the request's buffers, and pages the forked server shares with its parent
        assert reused < glibc / 10, (
            f"{reused} pages faulted in with the heap reused, {glibc} without"
        )
    assert busy - idle > 2 * MAP_BYTES, (
        f"resident {busy >> 20} MiB after the decode, {idle >> 20} MiB once idle"
    )
