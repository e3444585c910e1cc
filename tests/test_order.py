"""The two bf16 candidate orders the marked tests run in (tests/order.py) are really two: the
``swapped`` run reads the opposite of the environment's order, the ``native`` one its own."""

from __future__ import annotations

import os

import pytest

from app.runtime import modes
from tests import order

pytestmark = pytest.mark.bf16_order

ENVIRONMENT = os.environ.get("VAE_CPU_FAST_BF16")  # as the suite started (read at collection)


def test_each_order_is_the_one_its_parameter_names(request, monkeypatch):
    which = request.node.callspec.params[order.PARAM]
    seen = modes.cpu_has_fast_bf16()  # this test reads the order: it is marked
    if ENVIRONMENT is None:
        monkeypatch.delenv("VAE_CPU_FAST_BF16", raising=False)
    else:
        monkeypatch.setenv("VAE_CPU_FAST_BF16", ENVIRONMENT)
    environment = modes.cpu_has_fast_bf16()
    assert seen is (environment if which == "native" else not environment)
