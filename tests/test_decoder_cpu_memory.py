"""Each decoder family's planned memory on the CPU against the peak it measures there.

``working_bytes`` is measured on the meta device (``tests/test_memory_estimate.py``: op
outputs only, what a GPU holds beside cuDNN's workspace). On the CPU oneDNN also holds its
own copies of a conv's input and output (its blocked layout, a padded input's copy), so the
CPU plans ``planned_bytes``: the estimate times the family's ``cpu_margin``. It must cover
the real peak (``tests/cpu_memory.cpu_peak``) of every copy the CPU serves: the exact decoder
(float32, as stored), the float32 optimized copy and the bf16 one (where bf16 has kernels).
An estimate over the peak only refuses earlier (a 413), so there is no upper bound here; the
ratios are in docs/decoders.md.

Reduced widths (the published structure, widths / 4) on small outputs keep the file fast:
the maps, which are the peak, are linear in the width (docs/decoders.md lists full-width
measurements beside these).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from app.families import family, keys
from app.families.flux.decoder.model import FLUX1_CONFIG
from app.runtime import modes
from app.runtime.modes import Mode
from tests.cpu_memory import cpu_peak, served_zeroed
from tests.test_memory_estimate import HUNYUAN_VIDEO, LTX_091, WAN_21, latent_shape

F32, BF16 = torch.float32, torch.bfloat16
# (family, label, config, output (frames, height, width))
CASES: list[tuple[str, str, dict[str, Any], tuple[int, int, int]]] = [
    ("flux", "FLUX.1 /4", {**FLUX1_CONFIG, "block_out_channels": [32, 64, 128, 128]}, (1, 256, 256)),
    ("taesd", "TAEF1", {"variant": "taef1"}, (1, 256, 256)),
    ("wan", "Wan 2.1 /4", {**WAN_21, "decoder_base_dim": 24}, (5, 128, 128)),
    ("ltx", "LTX 0.9.1 /4", {**LTX_091, "decoder_block_out_channels": [64, 128, 256]}, (9, 128, 128)),
    ("hunyuan-video", "HunyuanVideo /4", {**HUNYUAN_VIDEO, "block_out_channels": [32, 64, 128, 128]}, (5, 128, 128)),
    ("minimax-h3", "MiniMax-H3, 2 layers", {"decoder_num_layers": 2}, (17, 128, 128)),
]  # fmt: skip
MODES = {"exact": modes.EXACT, "float32": Mode(F32), "bf16": Mode(BF16)}


def case_params() -> list[Any]:
    """Every case in every mode; a bf16 one needs bf16 kernels (tests/conftest.py)."""
    return [
        pytest.param(
            *case,
            mode,
            id=f"{case[0]}-{case[1].replace(' ', '_')}-{mode}",
            marks=[pytest.mark.bf16_kernels] if mode == "bf16" else [],
        )
        for case in CASES
        for mode in MODES
    ]


@pytest.mark.parametrize(("key", "label", "config", "size", "mode"), case_params())
def test_planned_bytes_cover_the_cpu_peak(key, label, config, size, mode) -> None:
    decoder = served_zeroed(family(key).decoder.module, config, MODES[mode])
    shape = latent_shape(decoder, *size)
    dtype = MODES[mode].dtype
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    peak = cpu_peak(lambda: decoder.decode(z))
    planned = decoder.planned_bytes(shape, z.element_size())
    ratio = planned / peak
    assert ratio >= 1.0, (
        f"{label} ({mode}) {size}: planned {planned / 2**20:.0f} MiB, "
        f"measured {peak / 2**20:.0f} MiB (x{ratio:.2f})"
    )


def test_every_family_is_measured() -> None:
    """A new family measures its ``cpu_margin`` here (docs/decoders.md, "Adding a family")."""
    assert {case[0] for case in CASES} == set(keys())
