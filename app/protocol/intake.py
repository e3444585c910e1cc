"""Where request bodies are parsed and checked: a thread pool of their own. Off the event loop,
which a large body's parse would stop for seconds (every other request, probes included);
and apart from the default pool that writes every answer, so that inputs slow to read (a
large image, an MP4's probe) delay only other inputs, never the answers of decodes done."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
POOL = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="intake")


async def parsed(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on the intake pool."""
    return await asyncio.get_running_loop().run_in_executor(POOL, functools.partial(fn, *args))
