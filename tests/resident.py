"""What a served decode adds to the process's resident set, and its allocator's peak: run as
its own process (``python -m tests.resident CASE...``), one JSON line per case.

The allocator's peak (``tests/cpu_memory.cpu_peak``) does not see what the kernel counts:
oneDNN re-orders a conv's weight into a buffer of its own on every call, glibc keeps freed
chunks of the worker's arena resident, and so on. The kernel's count is what kills a process,
so this measures it: in a fresh process (nothing freed earlier to reuse), each case's served
copy decodes once on a second thread (the service's worker is one; its arena differs from
the main thread's), the heap is trimmed, then the peak resident set (``VmHWM``, reset) over
one more decode less the resident set before it. The first decode is the allocator's peak
(``cpu_peak``), so each case's decoder is built and run in one place.
"""

from __future__ import annotations

import json
import sys
import threading

import torch

from app.families import family
from app.runtime import heap
from bench import common
from tests.cpu_memory import cpu_peak, served_zeroed


def grown(key: str, config: dict, shape: tuple[int, ...], mode: str) -> dict:
    """One case on a thread of its own: the resident growth, the allocator's peak and the
    plan, in bytes."""
    from tests.test_decoder_cpu_memory import MODES

    out: dict = {}

    def work() -> None:
        decoder = served_zeroed(family(key).decoder.module, config, MODES[mode])
        z = torch.zeros(shape, dtype=MODES[mode].dtype)
        out["peak"] = cpu_peak(lambda: decoder.decode(z))
        with torch.inference_mode():
            heap.release()
            base = common.rss_bytes()
            common.reset_peak_rss()  # VmHWM from here
            decoder.decode(z)
            out["grew"] = common.peak_rss_bytes() - base
        out["planned"] = decoder.planned_bytes(shape, z.element_size())

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    return out


def main(cases: list[str]) -> None:
    """Each argument: JSON ``[key, config, shape, mode]``."""
    for case in cases:
        key, config, shape, mode = json.loads(case)
        print(json.dumps(grown(key, config, tuple(shape), mode)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
