"""Every benchmark module imports against the current code (a stale import once made
``python -m bench wan`` vanish from the command's list without a word)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHES = ast.literal_eval(
    next(
        node.value
        for node in ast.parse(
            (Path(__file__).parents[1] / "bench" / "__main__.py").read_text()
        ).body
        if isinstance(node, ast.Assign) and node.targets[0].id == "BENCHES"
    )
)


@pytest.mark.parametrize("path", sorted(BENCHES.values()))
def test_bench_module_imports_and_declares_its_arguments(path):
    module = importlib.import_module(path)
    assert callable(module.run) and callable(module.add_arguments)


def test_table_rows_on_the_tiniest_shapes():
    """``python -m bench all``'s machinery on one small family: a row with every field, bf16
    reported as skipped when emulated, and the table and machine line printable."""
    table = importlib.import_module("bench.table")
    row = table.measure("ltx2", "tiny", repeats=1, skip_bf16=True)
    assert row["family"] == "ltx2" and row["shape"]
    assert row["peers"]["bf16"] == table.EMULATED
    assert row["best"] in ("fp32", "fp32+CL3d") and row["best_s"] > 0 and row["service_s"] > 0
    assert row["ratio"] == pytest.approx(row["best_s"] / row["service_s"])
    # the mode the service measured and chose here, at the parity its gate measured
    assert row["served"] in row["candidates"] and row["served_why"]
    assert row["gate_cos"] >= 0.9999
    exact = row["served"].startswith("float32")  # float32 (Winograd or not) is within rounding
    assert row["cos"] >= (0.99999 if exact else 0.9999)
    assert row["own_mib"] >= 0
    printed = table.format_table([row, {"family": "wan", "error": "boom"}])
    assert (
        "| ltx2 |" in printed and "skipped: bf16 emulated" in printed and "failed: boom" in printed
    )
    assert f"ltx2: served {row['served']} (" in printed
    assert set(table.cpu_flags()) == {"AVX2", "AVX-512-BF16", "AMX"}
    assert "AVX2" in table.machine_line()


def test_float32_table_measures_float32_on_both_sides():
    """``--float32``: the service's candidates are its float32 modes alone and diffusers'
    bf16 settings are skipped, so the row compares float32 with float32."""
    table = importlib.import_module("bench.table")
    row = table.measure("ltx2", "tiny", repeats=1, skip_bf16=False, float32_only=True)
    assert set(row["candidates"]) == {"float32", "float32 exact"}
    assert row["served"] in row["candidates"] and row["best"].startswith("fp32")
    assert row["peers"]["bf16"] == table.NOT_ASKED


def test_profile_rows_split_the_op_time():
    """``python -m bench profile`` on the tiniest shape: both sides profiled, the kinds' shares
    of the op time add up to one, and the conv/GEMM/attention FLOPs were counted."""
    import torch

    profile = importlib.import_module("bench.profile")
    measured = profile.measure("ltx2", "tiny", torch.float32)
    sides = [r["side"] for r in measured["rows"]]
    assert sides == ["diffusers fp32", "service float32"]
    for r in measured["rows"]:
        assert sum(r[k] for k in profile.KINDS) == pytest.approx(1.0)
        assert r["conv"] > 0 and r["gflop"] > 0 and r["rate"] > 0 and r["seconds"] > 0
    assert profile.kind("aten::mkldnn_convolution") == "conv"
    assert profile.kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert profile.kind("aten::convolution") == "rest"  # a wrapper: its kernel is counted


def test_flops_count_the_service_kernels():
    """The im2col conv (``ops.conv3d_direct``) and Winograd's in-place GEMMs count as the
    plain ops they compute."""
    import torch
    import torch.nn.functional as F

    from bench import common

    x, w = torch.randn(1, 8, 4, 6, 6), torch.randn(4, 8, 3, 3, 3)
    assert common.count_flops(
        lambda: torch.ops.aten.slow_conv3d(x, w, [3, 3, 3], None, [1, 1, 1], [0, 0, 0])
    ) == common.count_flops(lambda: F.conv3d(x, w))
    a, b = torch.randn(2, 3, 5), torch.randn(2, 5, 4)
    assert common.count_flops(lambda: torch.zeros(2, 3, 4).baddbmm_(a, b)) == 2 * 2 * 3 * 4 * 5


def test_family_rows_build_their_setups():
    """The rows' builders against the decoders' current interface (the table runs them only
    in subprocesses, where a renamed helper shows up as a failed row): MiniMax-H3's whole
    setup, and LTX's meta-device build on a small config, equal to a plain build."""
    import torch

    from app.families.ltx import decoder as ltx
    from bench import ltx as ltx_bench

    table = importlib.import_module("bench.table")
    assert "1 ViT3D block" in table.minimax_h3("tiny").shape
    c = ltx.SYNTHETIC["ltx-tiny"]["latent_channels"]
    config = dict(ltx.SYNTHETIC["ltx-tiny"], latents_mean=[0.5] * c, latents_std=[2.0] * c)
    built = ltx_bench.build_ours(seed=3, config=config)
    plain = ltx.Decoder(config).eval()
    ltx.init_synthetic(plain, torch.Generator().manual_seed(3))
    for (name, a), (_, b) in zip(
        built.state_dict().items(), plain.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert torch.equal(built.latents_std, plain.latents_std)
    z = torch.randn(1, c, 2, 4, 4)
    assert torch.equal(built.decode(z, seed=0), plain.decode(z, seed=0))


def test_own_bytes_counts_what_a_served_copy_adds():
    from torch import nn

    from app.families import winograd
    from bench.common import own_bytes

    reference = nn.Conv2d(128, 128, 3, padding=1)
    served = nn.Conv2d(128, 128, 3, padding=1)
    served.weight, served.bias = reference.weight, reference.bias  # shared, as on a CPU
    assert own_bytes(served, reference) == 0
    winograd.prepare(served)
    assert own_bytes(served, reference) == 36 * 128 * 128 * 4
