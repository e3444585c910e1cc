"""Each encoder family's ``Encoder.working_bytes`` against the peak it measures on the CPU.

The measured peak is that of PyTorch's CPU allocator during one ``moments``
(``tests/cpu_memory.cpu_peak``: oneDNN's and every op's temporaries included, the weights
not). The estimate must cover the peak without planning too much: 1.0x to
1.5x of it, as the decoders' (``tests/test_memory_estimate.py``).

Why not the decoders' meta-device ``live_peak``: it sees op outputs only, none of the
temporaries above, which the CPU holds too: the meta peak is well under the real one on
every family, several times under where a wide conv's weight or Winograd's buffers are the
peak (docs/encoders.md, "Memory"). So the encoder runs for real, with zero weights (memory
does not depend on them). To keep the file fast: the published widths on small inputs, where
the deep levels' weights count, and reduced widths (the published depth, strides, attention
and channel ratios; widths / 4 to / 8) on large inputs, where the full-resolution maps count,
linearly in the width. What is measured is what the service serves on the CPU: the exact
encoder (float32, as stored), else the copy ``modes.build`` makes for the case's mode (bf16
where marked; channels-last where the family's ``channels_last`` says so).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from app.families import family as described
from app.families import keys
from app.families.attention import attend
from app.runtime.modes import Mode
from tests.cpu_memory import cpu_peak, served_zeroed

F32, BF16 = torch.float32, torch.bfloat16
WAN22 = {
    "base_dim": 160,
    "z_dim": 48,
    "is_residual": True,
    "in_channels": 12,
    "patch_size": 2,
    "spatial_compression_ratio": 16,
}
FLUX_8 = {"block_out_channels": [16, 32, 64, 64], "norm_num_groups": 16}
FLUX_4 = {"block_out_channels": [32, 64, 128, 128]}
LTX_4 = {"block_out_channels": [32, 64, 128, 128]}
LTX2_4 = {"version": "ltx2", "block_out_channels": [64, 128, 256, 512], "latent_channels": 64}
HUNYUAN_8 = {"block_out_channels": [16, 32, 64, 64], "norm_num_groups": 16}
MINIMAX_8 = {"block_out_channels": [16, 32, 32, 64, 64, 128], "norm_num_groups": 16}
# (family, label, config, input shape, dtype, optimize): published widths on a small input,
# reduced ones on a large input (see the module docstring)
CASES: list[tuple[str, str, dict[str, Any], tuple[int, ...], torch.dtype, bool]] = [
    ("flux", "FLUX.1", {}, (1, 3, 192, 192), F32, False),
    ("flux", "FLUX.1 bf16", {}, (1, 3, 192, 192), BF16, False),
    ("flux", "FLUX.1 optimized", {}, (1, 3, 192, 256), F32, True),
    ("flux", "FLUX.1 /8", FLUX_8, (1, 3, 1024, 1024), F32, False),
    ("flux", "SDXL /4", {**FLUX_4, "latent_channels": 4, "use_quant_conv": True}, (1, 3, 512, 768), F32, False),
    ("flux", "FLUX.2 /4", {**FLUX_4, "latent_channels": 32, "use_quant_conv": True, "latent_bn": True}, (1, 3, 512, 768), F32, False),
    ("taesd", "TAEF1", {"variant": "taef1"}, (1, 3, 256, 256), F32, False),
    ("taesd", "TAEF2", {"variant": "taef2"}, (1, 3, 512, 512), F32, False),
    ("wan", "Wan 2.1", {}, (1, 3, 1, 128, 128), F32, False),
    ("wan", "Wan 2.1 /6", {"base_dim": 16}, (1, 3, 1, 512, 768), F32, False),
    ("wan", "Wan 2.1 /6", {"base_dim": 16}, (1, 3, 21, 128, 192), F32, False),
    ("wan", "Wan 2.1 /6 bf16", {"base_dim": 16}, (1, 3, 17, 128, 256), BF16, False),
    ("wan", "Wan 2.2", WAN22, (1, 3, 1, 128, 128), F32, False),
    ("wan", "Wan 2.2 /5", {**WAN22, "base_dim": 32}, (1, 3, 21, 128, 192), F32, False),
    ("ltx", "LTX 0.9", {}, (1, 3, 1, 256, 256), F32, False),
    ("ltx", "LTX 0.9 /4", LTX_4, (1, 3, 17, 256, 384), F32, False),
    ("ltx", "LTX-2", {"version": "ltx2"}, (1, 3, 1, 256, 256), F32, False),
    ("ltx", "LTX-2 /4", LTX2_4, (1, 3, 17, 256, 256), F32, False),
    # the default stream: 33 + 8 frames, memory flat in clip length
    ("ltx", "LTX 0.9 /4 stream", LTX_4, (1, 3, 41, 128, 192), F32, False),
    ("ltx", "LTX-2 /4 stream bf16", LTX2_4, (1, 3, 41, 128, 128), BF16, False),
    ("hunyuan-video", "HunyuanVideo", {}, (1, 3, 1, 128, 128), F32, False),
    ("hunyuan-video", "HunyuanVideo /8", HUNYUAN_8, (1, 3, 21, 192, 192), F32, False),
    ("hunyuan-video", "HunyuanVideo /8 bf16", HUNYUAN_8, (1, 3, 21, 192, 192), BF16, False),
    ("minimax-h3", "MiniMax-H3", {}, (1, 3, 1, 128, 128), F32, False),
    ("minimax-h3", "MiniMax-H3 /8", MINIMAX_8, (1, 3, 1, 448, 448), F32, False),
    ("minimax-h3", "MiniMax-H3 /8", MINIMAX_8, (1, 3, 35, 96, 128), F32, False),
]  # fmt: skip


def case_id(case: tuple) -> str:
    family, label, _, shape, _, _ = case
    return f"{family}-{label.replace(' ', '_')}-{'x'.join(map(str, shape[2:]))}"


def case_param(case: tuple) -> Any:
    """A bf16 case needs bf16 kernels: emulated bf16 takes another path (tests/conftest.py)."""
    marks = [pytest.mark.bf16_kernels] if case[4] == BF16 else []
    return pytest.param(*case, id=case_id(case), marks=marks)


@pytest.mark.parametrize(
    ("family", "label", "config", "shape", "dtype", "optimized"),
    [case_param(case) for case in CASES],
)
def test_estimate_covers_measured_peak(family, label, config, shape, dtype, optimized) -> None:
    encoder = served_zeroed(described(family).encoder.module, config, Mode(dtype, optimized))
    x = (torch.rand(shape, generator=torch.Generator().manual_seed(0)) * 2 - 1).to(dtype)
    peak = cpu_peak(lambda: encoder.moments(x))
    estimate = encoder.working_bytes(shape, x.element_size())
    ratio = estimate / peak
    assert 1.0 <= ratio <= 1.5, (
        f"{label} {list(shape)}: estimate {estimate / 2**20:.0f} MiB, "
        f"measured {peak / 2**20:.0f} MiB (x{ratio:.2f})"
    )


@pytest.mark.parametrize(
    ("family", "config", "shape"),
    [("hunyuan-video", HUNYUAN_8, (1, 3, 9, 320, 448))],
    ids=["hunyuan-video-/8-9x320x448"],
)
def test_tiled_estimate_covers_measured_peak(family, config, shape) -> None:
    """The plan of a tiled encode (what the runner runs past ``VAE_MAX_DECODE_MB``): one
    tile's pass and the window's tiles held for the blend."""
    encoder = served_zeroed(described(family).encoder.module, config, Mode(F32, False))
    assert encoder.supports_tiling
    x = torch.rand(shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
    peak = cpu_peak(lambda: encoder.moments(x, tiled=True))
    estimate = encoder.working_bytes(shape, 4, tiled=True)
    assert estimate < encoder.working_bytes(shape, 4)  # tiles plan less than the whole
    assert 1.0 <= estimate / peak <= 1.5, (estimate >> 20, peak >> 20)


def test_every_encoder_family_is_measured() -> None:
    """A family with an encoder measures its estimate here (docs/encoders.md, "Memory")."""
    assert {case[0] for case in CASES} == {k for k in keys() if described(k).encoder}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", [None, SDPBackend.MATH], ids=["fused", "math"])
def test_attention_holds_no_score_matrix(dtype: torch.dtype, backend: SDPBackend | None) -> None:
    """``attend`` over 4096 tokens, on strided q, k, v (as Wan's mid block makes them) with
    PyTorch's kernel choice or the math kernel forced: exact, and never near the 64 MiB of
    float32 scores (a few float32 q-sized tensors: the fused kernel, or query chunks of d
    rows, whose scores the math kernel computes in float32)."""
    tokens, d = 4096, 64
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, 3 * d, tokens, generator=gen).transpose(1, 2).unsqueeze(1)
    q, k, v = qkv.to(dtype).chunk(3, dim=-1)
    with sdpa_kernel([backend]) if backend else nullcontext():
        peak = cpu_peak(lambda: attend(q, k, v))
        out = attend(q, k, v)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    expected = torch.softmax(q64 @ k64.transpose(-1, -2) / d**0.5, dim=-1) @ v64
    cos = F.cosine_similarity(out.double().flatten(), expected.flatten(), dim=0)
    assert cos >= 0.99999
    assert peak < tokens**2 * 4 / 8
