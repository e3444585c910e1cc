"""Which tests consult the bf16 candidate order (``app.runtime.modes.candidate_modes`` asks
``cpu_has_fast_bf16`` when ``VAE_DTYPE=auto`` on a CPU): only those can change outcome
between the two orders, so only they run twice, in the order this machine reads and in the
other (``VAE_CPU_FAST_BF16``; ``tests/conftest.py`` parametrizes every test marked
``bf16_order``). ``tests/conftest.py`` fails a test that consulted the order without the
mark, so the mark stays complete. A test that sets ``VAE_CPU_FAST_BF16`` itself (each order
its own case) is marked ``bf16_order(set_by_test=True)``: it runs once."""

from __future__ import annotations

MARK = "bf16_order"
PARAM = "bf16_candidate_order"  # the parameter that says which order a marked test runs in
ORDERS = ["native", "swapped"]  # the environment's order, then the other
consults = 0  # in this process, and in the servers it started with VAE_DTYPE=auto


def note() -> None:
    """A consult the process cannot see: a server it started in a subprocess."""
    global consults
    consults += 1
