"""Which modes ``VAE_DTYPE=auto`` measures on a CPU: bf16 ones only where bf16 is not
emulated (a bf16 convolution measured within ``BF16_EMULATED`` times float32's), unless
``VAE_CPU_FAST_BF16`` forces an order; float32 alone for ``VAE_DTYPE=float32``."""

from __future__ import annotations

import pytest
import torch

from app.runtime import device, modes

CPU = torch.device("cpu")
F32 = [modes.Mode(torch.float32), modes.EXACT]
BF16 = [modes.Mode(torch.bfloat16), modes.Mode(torch.bfloat16, optimized=False)]


@pytest.mark.bf16_order(set_by_test=True)
@pytest.mark.parametrize(
    ("slowdown", "forced", "expected"),
    [
        (200.0, None, F32),  # AVX2: bf16 emulated
        (0.6, None, None),  # native bf16 (or slower but not emulated): all four, in order
        (200.0, "1", BF16 + F32),  # the tests' override: measured anyway, in its order
        (200.0, "0", F32 + BF16),
    ],
)
def test_auto_measures_bf16_only_where_it_is_not_emulated(monkeypatch, slowdown, forced, expected):
    monkeypatch.setattr(device, "cpu_bf16_slowdown", lambda: slowdown)
    if forced is None:
        monkeypatch.delenv("VAE_CPU_FAST_BF16", raising=False)
    else:
        monkeypatch.setenv("VAE_CPU_FAST_BF16", forced)
    if expected is None:
        expected = BF16 + F32 if device.cpu_has_fast_bf16() else F32 + BF16
    assert modes.candidate_modes("auto", CPU) == expected
    assert modes.candidate_modes("float32", CPU) == [modes.EXACT]
    assert modes.candidate_modes("bfloat16", CPU) == [modes.Mode(torch.bfloat16)]


def test_the_measured_slowdown_is_a_ratio_of_two_timed_convolutions():
    """Measured once per process: a positive ratio, the same on a second call."""
    slowdown = device.cpu_bf16_slowdown()
    assert 0 < slowdown < float("inf")
    assert device.cpu_bf16_slowdown() == slowdown
