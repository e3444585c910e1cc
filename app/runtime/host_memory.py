"""What the host can still give this process: the CPU's memory budget for one run.

Read from the kernel each time (two or three small files, microseconds): ``MemAvailable``
from ``/proc/meminfo``, within the container's cgroup limit (v2, else v1) less its working
set (its usage less the inactive file pages, which the kernel reclaims before it kills: how
container runtimes and Cloud Run count a container's memory). No library reads cgroups
this way (psutil reads the host's ``/proc/meminfo`` only), hence the hand-written reader.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def available() -> int:
    """Bytes this process may still take before the kernel (or its cgroup) runs out."""
    free = _meminfo("MemAvailable")
    cgroup = _cgroup()
    return max(0, free if cgroup is None else min(free, cgroup[0] - cgroup[1]))


def total() -> int:
    """Bytes the host gives this process at most: its memory, within the cgroup's limit."""
    memory = _meminfo("MemTotal")
    cgroup = _cgroup()
    return memory if cgroup is None else min(memory, cgroup[0])


def resident() -> int:
    """This process's resident set, in bytes."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) << 10
    raise RuntimeError(f"no {key} in /proc/meminfo")


def _cgroup() -> tuple[int, int] | None:
    """The cgroup's limit and working set (its usage less the inactive file pages); None
    without a limit (or a readable one)."""
    for limit_file, usage_file, inactive in (
        ("memory.max", "memory.current", "inactive_file"),  # v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_inactive_file"),
    ):
        try:
            text = (CGROUP / limit_file).read_text().strip()
            usage = int((CGROUP / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if text == "max" or int(text) >= UNLIMITED:
            return None
        stat = (CGROUP / limit_file).with_name("memory.stat")
        return int(text), usage - _stat(stat, inactive)
    return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
