"""Where a decode's time goes: the served copy's ops against diffusers', family by family.

    python -m bench profile [--quick] [--only FAMILY ...] [--mode bfloat16|float32]
                            [--repeats 3] [--threads N]

Each row is ``bench.table``'s setup (same rows, shapes and seeded weights). The service side
is the copy of ``--mode`` (optimized: the fast path the gate would measure), diffusers' side
its first setting of the same dtype (bf16 / bf16+CL, or fp32; none for a family without a
bench module). Each decodes once as a
warm-up, then ``--repeats`` times under ``torch.profiler`` (the fastest kept) and once under
``FlopCounterMode``. A row gives the profiled decode's seconds, the share of its op time in convolutions, GEMMs and attention
(the rest is elementwise work, copies and norms), and the FLOPs of those three over the time
they took, beside the machine's GEMM rate: a row whose rate is near the GEMM rate and whose
rest is small has nothing left to gain but FLOPs.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from app.runtime import modes
from bench import common, table

CPU = torch.device("cpu")
KINDS = ("conv", "gemm", "attention", "rest")
CONV = {
    "aten::mkldnn_convolution",
    "aten::slow_conv3d_forward",
    "aten::_slow_conv2d_forward",
    "aten::_nnpack_spatial_convolution",
}
GEMM = {"aten::addmm", "aten::addmm_", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::baddbmm_"}


def kind(op: str) -> str:
    """What an op's self time counts as (the kernels, not their wrappers)."""
    if op in CONV:
        return "conv"
    if op in GEMM:
        return "gemm"
    return "attention" if "scaled_dot_product" in op and "for_cpu" in op else "rest"


def profiled(decode: table.Decode) -> tuple[float, dict[str, float]]:
    """One decode's seconds and each kind's self seconds."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        decode()
        wall = time.perf_counter() - t0
    seconds = dict.fromkeys(KINDS, 0.0)
    for event in prof.key_averages():
        seconds[kind(event.key)] += event.self_cpu_time_total / 1e6
    return wall, seconds


def row(side: str, decode: table.Decode, repeats: int) -> dict:
    """The fastest of ``repeats`` profiled decodes after a warm-up: its seconds, each kind's
    share of the op time, and the FLOPs of the conv, GEMM and attention kernels over their
    time."""
    decode()
    wall, seconds = min((profiled(decode) for _ in range(repeats)), key=lambda p: p[0])
    busy, total = sum(seconds.values()) - seconds["rest"], sum(seconds.values())
    flops = common.count_flops(decode)
    return {
        "side": side,
        "seconds": wall,
        **{k: seconds[k] / total for k in KINDS},
        "gflop": flops / 1e9,
        "rate": flops / busy / 1e9 if busy else 0.0,
    }


@torch.inference_mode()
def measure(name: str, scale: str, dtype: torch.dtype, repeats: int = 1) -> dict:
    """The row's shape, and its diffusers row (where it has a peer) and service row at
    ``dtype``."""
    setup = table.setups()[name](scale)
    prefix = "bf16" if dtype == torch.bfloat16 else "fp32"
    setting = next((k for k in setup.peers if k.startswith(prefix)), None)
    rows = [row(f"diffusers {setting}", setup.peers[setting](), repeats)] if setting else []
    mode, decode, _ = setup.served(lambda reference: modes.Mode(dtype))  # no selection
    rows.append(row(f"service {mode}", decode, repeats))
    return {"shape": setup.shape, "rows": rows}


def format_rows(family: str, measured: dict) -> str:
    return "\n".join(
        f"| {family} | {measured['shape']} | {r['side']} | {r['seconds']:.2f} "
        + " ".join(f"| {100 * r[k]:.0f}%" for k in KINDS)
        + f" | {r['gflop']:.0f} | {r['rate']:.0f} |"
        for r in measured["rows"]
    )


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    scale = "quick" if args.quick else args.scale
    dtype = modes.DTYPES[args.mode]
    if args.child:
        return print(json.dumps(measure(args.child, scale, dtype, args.repeats)))
    print(table.machine_line())
    rate = common.gemm_rate(dtype, CPU)
    print(f"GEMM rate: {str(dtype)[6:]} {rate / 1e9:.0f} GFLOP/s")
    print(
        "| family | shape | side | s | conv | GEMM | attention | rest "
        "| GFLOP | conv+GEMM+attention GFLOP/s |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for family in args.only or table.setups():
        command = ["profile", "--child", family]
        command += ["--scale", scale, "--mode", args.mode, "--threads", str(args.threads)]
        command += ["--repeats", str(args.repeats)]
        measured = common.bench_child(command)
        if "error" in measured:
            print(f"| {family} | failed: {measured['error']} |||||||||")
            continue
        print(format_rows(family, measured), flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small shapes (= --scale quick)")
    parser.add_argument("--scale", choices=table.SCALES, default="full", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", choices=list(table.setups()), help="rows")
    parser.add_argument("--mode", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="profiled decodes, the fastest kept")
    parser.add_argument("--child", help=argparse.SUPPRESS)
