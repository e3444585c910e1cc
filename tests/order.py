"""Which tests consult the bf16 candidate order (``app.runtime.modes.candidate_modes`` asks
``cpu_has_fast_bf16`` when ``VAE_DTYPE=auto`` on a CPU): only those can change outcome
between the two orders, so ``make test`` runs only them a second time, in the other order
(``VAE_CPU_FAST_BF16``). ``tests/conftest.py`` fails a test that consulted it without the
``bf16_order`` mark on its module, so the mark stays complete."""

from __future__ import annotations

MARK = "bf16_order"
consults = 0  # in this process, and in the servers it started with VAE_DTYPE=auto


def note() -> None:
    """A consult the process cannot see: a server it started in a subprocess."""
    global consults
    consults += 1
