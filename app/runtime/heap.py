"""The process heap (glibc): a decode's freed tensors are reused by its next ops, and the
heap's free pages go back to the OS once the worker is idle.

A decode allocates and frees maps of tens to hundreds of MiB op after op. By default glibc
serves each one past its mmap threshold (32 MiB at most) with a fresh ``mmap`` and unmaps it
on free, trims its heap top past the trim threshold, and gives a second thread an arena of
64 MiB heaps, where anything larger is mmapped whatever the threshold: so every op's output
is page-faulted in, zeroed by the kernel, again (measured: docs/BENCHMARKS.md, "The heap").
``reuse`` keeps every thread in the main arena and lifts both thresholds, so a freed map is
the next op's memory; ``release`` gives the free pages back (``malloc_trim``): the worker
calls it once it has been idle, and the body budget after a burst of large uploads.

Hand-written (ctypes, a few lines) rather than a preloaded allocator (jemalloc, tcmalloc): it
needs nothing installed or set before the process starts, and glibc is every image's libc.
Elsewhere (musl, macOS) both calls do nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger("app.runtime.heap")

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
LARGEST = 2**31 - 1  # mallopt takes an int


def _glibc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()
_reusing = False  # set once, by ``reuse`` before the service's threads start


def available() -> bool:
    """Whether this process's allocator is glibc's (else both calls do nothing)."""
    return _LIBC is not None


def reuse() -> bool:
    """Keep freed memory in the heap for the next allocation. Call it before the process starts
    its threads (a thread's arena is chosen at its first allocation). Whether it took."""
    global _reusing
    if _LIBC is None:
        return False
    taken = all(
        _LIBC.mallopt(param, value)
        for param, value in (
            (M_ARENA_MAX, 1),
            (M_MMAP_THRESHOLD, LARGEST),
            (M_TRIM_THRESHOLD, LARGEST),
        )
    )
    if taken:
        _reusing = True
        log.info("VAE_HEAP_REUSE: freed memory is reused; its pages go back once the worker idles")
    else:
        log.warning("glibc refused the heap settings: decodes page-fault their maps in")
    return taken


def release() -> None:
    """Give the heap's free pages back to the OS (it walks the whole heap: not per request)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def release_when_reusing() -> None:
    """The worker's idle hook: with ``reuse``, the pages it kept go back; else glibc has
    already given back what it would."""
    if _reusing:
        release()
