"""``python -m tests.loop_cpu serve ...``: the real command line, with the CPU time of each
event-loop callback measured on the loop's thread; one JSON line per callback of more than
``THRESHOLD_S`` appended to ``$LOOP_CPU_LOG`` (when it ran, its CPU seconds, what it was).
With ``$LOOP_CPU_COLLECT_S`` the loop also runs a full garbage collection that often, as the
collector would on its own at some point (when is its heuristic's: a test cannot wait for it).

CPU time, not wall time: work done on the loop (a body parsed there, a full garbage
collection) costs its CPU however loaded the machine is, while a loaded machine stretches
the wall time of every callback, and of any probe's answer, with no fault of the server's."""

from __future__ import annotations

import asyncio
import asyncio.events
import gc
import json
import os
import time

from app.cli import main

THRESHOLD_S = 0.02
_run = asyncio.events.Handle._run
_collecting = False


def _what(handle: asyncio.events.Handle) -> str:
    """A request's step names its request; any other callback its own repr."""
    task = getattr(handle._callback, "__self__", None)
    if not isinstance(task, asyncio.Task):
        return getattr(handle._callback, "__qualname__", None) or repr(handle)[:300]
    coro = task.get_coro()
    frame = coro.cr_frame.f_locals if coro.cr_frame else {}
    scope = getattr(frame.get("self"), "scope", None) or {}
    request = f" {scope.get('method')} {scope.get('path')}" if scope else ""
    return f"{coro.__qualname__}{request}"


def _collect_every(seconds: float) -> None:
    gc.collect()
    asyncio.get_running_loop().call_later(seconds, _collect_every, seconds)


def _timed(handle: asyncio.events.Handle) -> None:
    global _collecting
    if not _collecting and os.environ.get("LOOP_CPU_COLLECT_S"):
        _collecting = True
        seconds = float(os.environ["LOOP_CPU_COLLECT_S"])
        asyncio.get_running_loop().call_later(seconds, _collect_every, seconds)
    start = time.thread_time()
    try:
        _run(handle)
    finally:
        spent = time.thread_time() - start
        if spent > THRESHOLD_S:
            line = {"at": time.time(), "cpu_s": round(spent, 4), "callback": _what(handle)}
            with open(os.environ["LOOP_CPU_LOG"], "a") as log:
                log.write(json.dumps(line) + "\n")


asyncio.events.Handle._run = _timed  # TimerHandle's too: it inherits ``_run``
main()
