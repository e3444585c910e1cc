"""The CPU's memory budget: what the host, its cgroup's limit first, still has for this
process (``app/runtime/host_memory.py``)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from app.runtime import host_memory


def test_available_is_within_the_hosts_memory_and_resident_sees_touched_pages() -> None:
    total = host_memory._meminfo("MemTotal")
    assert 0 < host_memory.available() <= host_memory.total() <= total
    # a mapping of its own: a tensor could reuse pages the heap kept resident from earlier tests
    mapped = mmap.mmap(-1, 256 << 20)
    before = host_memory.resident()
    pages = np.frombuffer(mapped, dtype=np.uint8)
    pages[:: mmap.PAGESIZE] = 1  # touch every page
    grown = host_memory.resident() - before
    del pages
    mapped.close()
    assert grown >= 200 << 20


def make_cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "cgroup"),
    [
        # v2: limit 4 GiB, usage 3 GiB of which 1 GiB inactive file pages -> (4, 2) GiB
        ({"memory.max": "4294967296\n", "memory.current": "3221225472\n",
          "memory.stat": "anon 1\ninactive_file 1073741824\nactive_file 5\n"}, (4 << 30, 2 << 30)),
        ({"memory.max": "max\n", "memory.current": "1\n", "memory.stat": ""}, None),
        # v1: the same, and v1's "no limit" (2**63 - 1 rounded to a page)
        ({"memory/memory.limit_in_bytes": "4294967296\n",
          "memory/memory.usage_in_bytes": "3221225472\n",
          "memory/memory.stat": "inactive_file 0\ntotal_inactive_file 1073741824\n"}, (4 << 30, 2 << 30)),
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n",
          "memory/memory.usage_in_bytes": "5\n"}, None),
        ({}, None),  # no cgroup memory controller mounted
    ],
    ids=["v2", "v2-max", "v1", "v1-unlimited", "none"],
)  # fmt: skip
def test_the_cgroup_bounds_the_total_and_its_room_the_available(
    tmp_path, monkeypatch, files, cgroup
):
    """The total is the limit (where under the host's memory); what is available, the limit
    less the working set (the usage less the inactive file pages)."""
    monkeypatch.setattr(host_memory, "CGROUP", make_cgroup(tmp_path, files))
    assert host_memory._cgroup() == cgroup
    total, available = host_memory._meminfo("MemTotal"), host_memory._meminfo("MemAvailable")
    if cgroup is not None:
        limit, working_set = cgroup
        total, available = min(total, limit), min(available, limit - working_set)
    assert host_memory.total() == total
    assert abs(host_memory.available() - available) < 256 << 20  # MemAvailable moves
