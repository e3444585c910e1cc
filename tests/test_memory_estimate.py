"""Each family's ``Decoder.working_bytes`` against the peak it measures.

The measured peak is ``bench.meta_memory.live_peak``: the live tensor bytes of one ``decode``
on the meta device (no memory, no arithmetic), of the full-size model built there in bf16 as
served (``optimize`` applied), at the sizes samplers render (issue 23). The estimate must
cover the peak without planning too much: 1.0x to 1.5x of it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from app.families import family
from app.families.flux.decoder.model import FLUX1_CONFIG
from app.families.hunyuan_video import decoder as hunyuan_video
from app.families.ltx.decoder import ltx2
from app.families.ltx.decoder.model import DEFAULTS as LTX_DEFAULTS
from app.families.wan import decoder as wan
from bench.meta_memory import live_peak

LTX_091 = {
    **LTX_DEFAULTS,
    "decoder_block_out_channels": [256, 512, 1024],
    "decoder_layers_per_block": [5, 6, 7, 8],
    "decoder_spatio_temporal_scaling": [True, True, True],
    "decoder_inject_noise": [True, True, True, False],
    "upsample_residual": [True, True, True],
    "upsample_factor": [2, 2, 2],
    "timestep_conditioning": True,
}
WAN_21 = {**wan.SYNTHETIC["wan2.1-tiny"], "decoder_base_dim": 96, "num_res_blocks": 2}
HUNYUAN_VIDEO = {
    **hunyuan_video.SYNTHETIC["hunyuan-video-tiny"],
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
}
# (family, config, (frames, height, width), tiled)
CASES: list[tuple[str, dict[str, Any], tuple[int, int, int], bool]] = [
    ("flux", FLUX1_CONFIG, (1, 1024, 1024), False),
    ("flux", FLUX1_CONFIG, (1, 1024, 1024), True),
    ("taesd", {"variant": "taef1"}, (1, 1024, 1024), False),
    ("ltx", LTX_091, (121, 512, 768), False),
    ("ltx", ltx2.DEFAULTS, (121, 704, 1216), False),
    ("wan", WAN_21, (81, 480, 832), False),
    ("wan", WAN_21, (81, 720, 1280), False),
    ("hunyuan-video", HUNYUAN_VIDEO, (61, 544, 960), False),
    ("hunyuan-video", HUNYUAN_VIDEO, (61, 544, 960), True),
    ("hunyuan-video", HUNYUAN_VIDEO, (129, 720, 1280), False),
    ("hunyuan-video", HUNYUAN_VIDEO, (129, 720, 1280), True),
]
# MiniMax-H3 at its real size (209x768x1344, whole: it cannot tile) is the video proof's meta
# row, the same measure and bound: tests/test_gpu_proof.py (one meta decode of it, not two)


def served_on_meta(key: str, config: dict[str, Any]) -> Any:
    """The full-size decoder on the meta device in bf16, optimized as the served copy is."""
    with torch.device("meta"):
        decoder = family(key).decoder.module(dict(config)).to(torch.bfloat16).eval()
    decoder.optimize()
    return decoder


def latent_shape(decoder: Any, frames: int, height: int, width: int) -> tuple[int, ...]:
    s = decoder.spatial_scale
    if not decoder.is_video:
        return (1, decoder.latent_channels, height // s, width // s)
    t = (frames - 1) // decoder.temporal_scale + 1
    return (1, decoder.latent_channels, t, height // s, width // s)


def measured_peak(decoder: Any, shape: tuple[int, ...], tiled: bool) -> int:
    z = torch.empty(shape, device="meta", dtype=torch.bfloat16)
    options = {"tiled": tiled} if decoder.supports_tiling else {}
    return live_peak(lambda: decoder.decode(z, **options))


@pytest.mark.parametrize(
    ("family", "config", "size", "tiled"),
    CASES,
    ids=[f"{f}-{'x'.join(map(str, s))}{'-tiled' if t else ''}" for f, _, s, t in CASES],
)
def test_estimate_covers_measured_peak(family, config, size, tiled) -> None:
    decoder = served_on_meta(family, config)
    shape = latent_shape(decoder, *size)
    peak = measured_peak(decoder, shape, tiled)
    estimate = decoder.working_bytes(shape, 2, tiled=tiled)
    ratio = estimate / peak
    assert 1.0 <= ratio <= 1.5, (
        f"{family} {size} tiled={tiled}: estimate {estimate / 2**20:.0f} MiB, "
        f"measured {peak / 2**20:.0f} MiB (x{ratio:.2f})"
    )


def test_tiled_estimate_is_smaller_where_tiles_are() -> None:
    """What the runner's tiled fallback relies on: a tiled decode plans less memory."""
    for key, config in (("flux", FLUX1_CONFIG), ("hunyuan-video", HUNYUAN_VIDEO)):
        decoder = served_on_meta(key, config)
        shape = latent_shape(decoder, 61, 720, 1280)
        assert decoder.working_bytes(shape, 2, tiled=True) < decoder.working_bytes(shape, 2)
