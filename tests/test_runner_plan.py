"""The runner's first plan for each full-size family under an emulated L4 (21.5 GiB): the
decoder's own ``planned_bytes`` (``working_bytes`` times the family's ``gpu_margin``) against
the budget the runner plans into (issue 23.3).

A decode that fits is never tiled (tiles change the output); one that does not is tiled
where the family can tile, and the tiled decode then fits; MiniMax-H3 209x768x1344 is served
(not refused: it cannot tile, and it does not need to), LTX-2 and Wan 720p decode untiled.
The models are built on the meta device (no memory), so this runs on any CPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from app.families.ltx.decoder import ltx2
from app.families.minimax_h3.decoder.model import DEFAULTS as MINIMAX_DEFAULTS
from app.runtime.runner import PLANNING_SHARE, Runner
from app.telemetry.metrics import Metrics
from tests.test_memory_estimate import (
    CASES,
    HUNYUAN_VIDEO,
    WAN_21,
    latent_shape,
    served_on_meta,
)

L4_BYTES = int(21.5 * 2**30)  # what VAE_DEVICE_MEMORY_GB=21.5 emulates
UNTILED = sorted({(f, tuple(s)): c for f, c, s, _ in CASES}.items())


def first_plan(family: str, config: dict, size: tuple[int, int, int], card: int = L4_BYTES):
    """(the runner's first attempt, the decoder, the latent shape, the planning budget) on a
    card of ``card`` bytes, the default ``VAE_MAX_DECODE_MB`` (16 GiB) per request."""
    decoder = served_on_meta(family, config)
    weights = sum(p.numel() * p.element_size() for p in decoder.parameters())
    runner = Runner(Metrics(), budget=card - weights)  # the model resident on the card
    shape = latent_shape(decoder, *size)
    # a served model whose gate passed every check: every decode runs on its fast copy
    model = SimpleNamespace(
        part="decoder", active=decoder, fast=decoder, compiled={}, decoder_for=lambda _: decoder
    )
    attempt = runner._first_attempt(model, torch.empty(shape, device="meta"))
    budget = min(int((card - weights) * PLANNING_SHARE), runner.max_planned_bytes)
    return attempt, decoder, shape, budget


def untiled(attempt, decoder) -> bool:
    """The attempt decodes whole: ``tiled=False`` where the family tiles, no option (None)
    where it cannot tile at all."""
    return attempt.tiled is (False if decoder.supports_tiling else None)


@pytest.mark.parametrize(
    ("family", "size", "config"),
    [(f, s, c) for (f, s), c in UNTILED],
    ids=[f"{f}-{'x'.join(map(str, s))}" for (f, s), _ in UNTILED],
)
def test_fits_untiled_else_tiled_that_fits(family, size, config) -> None:
    attempt, decoder, shape, budget = first_plan(family, config, size)
    whole = decoder.planned_bytes(shape, 2)  # on a GPU (and meta): the estimate x gpu_margin
    if whole <= budget:
        assert untiled(attempt, decoder), f"{family} {size} fits ({whole >> 20} MiB) but is tiled"
    else:
        assert decoder.supports_tiling and attempt.tiled is True
        assert decoder.working_bytes(shape, 2, tiled=True) * decoder.gpu_margin <= budget


@pytest.mark.parametrize(
    ("family", "config", "size"),
    [
        ("minimax-h3", MINIMAX_DEFAULTS, (209, 768, 1344)),
        ("ltx", ltx2.DEFAULTS, (121, 704, 1216)),
        ("wan", WAN_21, (81, 720, 1280)),
        ("wan", WAN_21, (81, 480, 832)),
    ],
    ids=["minimax-h3-209x768x1344", "ltx2-121x704x1216", "wan-81x720x1280", "wan-81x480x832"],
)
def test_served_whole_on_an_l4(family, config, size) -> None:
    attempt, decoder, *_ = first_plan(family, config, size)
    assert untiled(attempt, decoder) and attempt.label == "served"


H200_BYTES = int(139.8 * 2**30)


@pytest.mark.parametrize(
    ("family", "config", "size", "whole"),
    [
        ("hunyuan-video", HUNYUAN_VIDEO, (129, 720, 1280), False),
        ("hunyuan-video", HUNYUAN_VIDEO, (61, 544, 960), False),
        ("wan", WAN_21, (81, 720, 1280), True),
        ("ltx", ltx2.DEFAULTS, (121, 704, 1216), True),
    ],
    ids=["hunyuan-129x720x1280", "hunyuan-61x544x960", "wan-81x720x1280", "ltx2-121x704x1216"],
)
def test_a_large_card_tiles_what_one_request_may_not_plan_whole(family, config, size, whole):
    """On an H200 HunyuanVideo at its native sizes would fit whole (27 and 48 GiB planned), but
    one request may plan at most ``VAE_MAX_DECODE_MB`` (16 GiB): the runner decodes it tiled,
    as the 413 check admitted it; what plans within the cap decodes whole."""
    attempt, decoder, shape, budget = first_plan(family, config, size, H200_BYTES)
    assert (decoder.planned_bytes((1, *shape[1:]), 2) <= budget) is whole
    assert untiled(attempt, decoder) is whole and (attempt.tiled is True) is not whole
