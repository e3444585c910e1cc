"""The CPU's memory budget: what the host, its cgroup's limit first, still has for this
process (``app/runtime/host_memory.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.runtime import host_memory


def test_available_is_within_the_hosts_memory_and_resident_sees_a_touched_tensor() -> None:
    total = host_memory._meminfo("MemTotal")
    assert 0 < host_memory.available() <= total
    before = host_memory.resident()
    held = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB, touched
    assert host_memory.resident() - before >= 200 << 20
    del held


def cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "room"),
    [
        # v2: limit 4 GiB, usage 3 GiB of which 1 GiB inactive file pages -> 2 GiB of room
        ({"memory.max": "4294967296\n", "memory.current": "3221225472\n",
          "memory.stat": "anon 1\ninactive_file 1073741824\nactive_file 5\n"}, 2 << 30),
        ({"memory.max": "max\n", "memory.current": "1\n", "memory.stat": ""}, None),
        # v1: the same, and v1's "no limit" (2**63 - 1 rounded to a page)
        ({"memory/memory.limit_in_bytes": "4294967296\n",
          "memory/memory.usage_in_bytes": "3221225472\n",
          "memory/memory.stat": "inactive_file 0\ntotal_inactive_file 1073741824\n"}, 2 << 30),
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n",
          "memory/memory.usage_in_bytes": "5\n"}, None),
        ({}, None),  # no cgroup memory controller mounted
    ],
    ids=["v2", "v2-max", "v1", "v1-unlimited", "none"],
)  # fmt: skip
def test_the_cgroups_room_is_its_limit_less_its_working_set(tmp_path, monkeypatch, files, room):
    monkeypatch.setattr(host_memory, "CGROUP", cgroup(tmp_path, files))
    assert host_memory._cgroup_room() == room
    expected = host_memory._meminfo("MemAvailable")
    if room is not None:
        expected = min(expected, room)
    assert abs(host_memory.available() - expected) < 256 << 20  # MemAvailable moves
