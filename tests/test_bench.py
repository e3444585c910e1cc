"""Every benchmark module imports against the current code (a stale import once made
``python -m bench wan`` vanish from the command's list without a word)."""

from __future__ import annotations

import importlib

import pytest

from app import families as registry
from app.families.descriptor import Family, Part, Recipe
from app.families.minimax_h3 import decoder as mm_decoder
from app.families.minimax_h3 import encoder as mm_encoder
from bench.__main__ import benches


# a throwaway family with no bench module (registered by the tests that bench it): MiniMax-H3's
# tiny model under classes of its own, so the descriptor names them and not MiniMax-H3's
class _StandInDecoder(mm_decoder.Decoder):
    pass


class _StandInEncoder(mm_encoder.Encoder):
    pass


STAND_IN = "bench-stand-in"
FAMILY = Family(
    key=STAND_IN,
    decoder=Part(_StandInDecoder, mm_decoder.convert, mm_decoder.init_synthetic),
    encoder=Part(_StandInEncoder, mm_encoder.convert, mm_encoder.init_synthetic),
    synthetic={
        "stand-in-tiny": Recipe(
            mm_decoder.SYNTHETIC["minimax-h3-tiny"], mm_encoder.SYNTHETIC["minimax-h3-tiny"]
        )
    },
)


@pytest.fixture
def stand_in():
    registry.register(STAND_IN, __name__)
    yield STAND_IN
    registry.unregister(STAND_IN)


@pytest.mark.parametrize("path", sorted(set(benches().values())))
def test_bench_module_imports_and_declares_its_arguments(path):
    module = importlib.import_module(path)
    assert callable(module.run) and callable(module.add_arguments)


def test_commands_and_rows_come_from_the_descriptors():
    """Every family's bench modules are commands and rows of ``python -m bench all`` under the
    descriptor's names, each with its own ``table_setup``; a family without one is a row."""
    from app.families import families

    table = importlib.import_module("bench.table")
    rows = table.setups()
    for key, family in families().items():
        for row, module in family.bench.items():
            assert benches()[row] == module
            assert callable(importlib.import_module(module).table_setup)
        assert set(family.bench) <= set(rows) and (family.bench or key in rows)
    assert set(rows) == {r for f in families().values() for r in f.bench or [f.key]}


@pytest.mark.bf16_order
def test_a_family_without_a_bench_module_is_benched_on_its_served_path(stand_in):
    """A new family is a row of ``python -m bench all`` and of ``bench encode`` with no bench
    code: its first recipe's served copy timed on its gate probe, chosen as the service
    chooses, with no peer (no ratio, no cosine against diffusers)."""
    table = importlib.import_module("bench.table")
    encode = importlib.import_module("bench.encode")
    assert stand_in in table.setups() and stand_in in encode.setups()
    assert stand_in not in benches()  # no bench module: no command of its own
    row = table.measure(stand_in, "tiny", repeats=1, skip_bf16=True)
    assert row["shape"].startswith("stand-in-tiny, probe ") and row["peers"] == {}
    assert row["best"] == table.NO_PEER and row["ratio"] is None and row["cos"] is None
    assert row["service_s"] > 0 and row["served"] in row["candidates"]
    printed = table.format_table([row])
    assert f"| {stand_in} | stand-in-tiny, probe " in printed and "| no peer |  |" in printed
    encoded = encode.measure(stand_in, quick=True, repeats=1, skip_bf16=True)
    assert encoded["best"] == encode.NO_PEER and encoded["ratio"] is None
    assert encoded["cos_served"] >= 0.9999 and encoded["served_why"]
    assert f"| {stand_in} | stand-in-tiny, probe " in encode.format_table([encoded])


@pytest.mark.bf16_order
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


@pytest.mark.bf16_order
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


def test_heap_rows_time_fault_and_grow():
    """``python -m bench heap``'s row on the tiniest shape (this process's heap, as it is):
    a decode timed on a second thread, its page faults and resident growth read."""
    heap = importlib.import_module("bench.heap")
    row = heap.measure("taesd", "tiny", "float32", repeats=1)
    assert row["seconds"] > 0 and row["faults"] >= 0 and row["grew"] >= 0
    assert row["served"] == "float32"
    line = heap.format_row("taesd", row, {**row, "seconds": row["seconds"] / 2})
    assert "| 2.00x |" in line


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
    assert "1 ViT3D block" in table.setups()["minimax-h3"]("tiny").shape
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
