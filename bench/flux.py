"""FLUX.1 decoder: the service's paths vs diffusers' AutoencoderKL, same weights, same process.

    python -m bench flux --size 512 [--repeats 3] [--memory]

Prints one row per variant: median seconds, ratio against diffusers' best setting measured
in this run, effective FLOP/s (the reference architecture's FLOPs over time) against the
machine's GEMM rate measured in this run, and output cosine against the float32 CPU path.
``--memory`` measures each variant's peak resident memory in a fresh subprocess.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch
from diffusers import AutoencoderKL

from app.families.flux import decoder as flux
from app.families.flux.decoder.model import FLUX1_CONFIG
from app.families.ops import cosine
from app.runtime import modes
from app.runtime.device import cpu_has_fast_bf16
from bench import common, table


def build(seed: int = 0) -> tuple[flux.Decoder, AutoencoderKL]:
    ours = flux.Decoder(FLUX1_CONFIG)
    flux.init_synthetic(ours, torch.Generator().manual_seed(seed))
    ours.eval().requires_grad_(False)
    cfg = FLUX1_CONFIG
    n = len(cfg["block_out_channels"])
    ref = AutoencoderKL(
        latent_channels=16,
        block_out_channels=tuple(cfg["block_out_channels"]),
        layers_per_block=cfg["layers_per_block"],
        use_quant_conv=False,
        use_post_quant_conv=False,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
    )
    ref.decoder.load_state_dict(ours.state_dict())
    del ref.encoder  # decode only, as the service holds
    return ours, ref.eval().requires_grad_(False)


def variants(ours: flux.Decoder, ref: AutoencoderKL, device: torch.device) -> dict:
    """name -> (callable taking a latent, device). Built lazily so --memory builds one."""

    def peer(dtype: torch.dtype, channels_last: bool):
        def make():
            model = copy.deepcopy(ref).to(device=device, dtype=dtype)
            if channels_last:
                model = model.to(memory_format=torch.channels_last)
            return lambda z: model.decode(z.to(device, dtype)).sample

        return make

    def service(dtype: torch.dtype, banded: bool):
        def make():
            model = modes.build(ours, device, modes.Mode(dtype))  # what the gate would serve
            model.band_min_pixels = 0 if banded else 1 << 62  # force either way
            return lambda z: model.decode(z.to(device))

        return make

    return {
        "diffusers fp32": peer(torch.float32, False),
        "diffusers fp32+CL": peer(torch.float32, True),
        "diffusers bf16+CL": peer(torch.bfloat16, True),
        "service exact fp32": lambda: lambda z: ours.decode(z),
        "service fast fp32": service(torch.float32, False),
        "service fast fp32 banded": service(torch.float32, True),
        "service fast bf16 banded": service(torch.bfloat16, True),
    }


VARIANT_NAMES = (
    "diffusers fp32",
    "diffusers fp32+CL",
    "diffusers bf16+CL",
    "service exact fp32",
    "service fast fp32",
    "service fast fp32 banded",
    "service fast bf16 banded",
)


@torch.inference_mode()
def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ours, ref = build()
    z = torch.randn(
        1, 16, args.size // 8, args.size // 8, generator=torch.Generator().manual_seed(1)
    )
    if args.child:
        return _child(args, ours, ref, z, device)
    print(f"machine: {common.machine()}")
    if args.memory_only:
        return _memory(args)
    rates = {d: common.gemm_rate(d, device) for d in (torch.float32, torch.bfloat16)}
    print(
        "GEMM rate: " + ", ".join(f"{str(d)[6:]} {r / 1e9:.0f} GFLOP/s" for d, r in rates.items())
    )
    flops = common.meta_flops(ours, tuple(z.shape))  # meta: CPU SDPA is not counted
    print(
        f"FLUX.1 decoder {args.size}x{args.size}: {flops / 1e12:.2f} TFLOP (reference architecture)"
    )
    exact = ours.decode(z)
    slow_bf16 = rates[torch.bfloat16] < rates[torch.float32] / 4 and not args.force_bf16
    if slow_bf16:
        print("bf16 GEMMs are emulated on this CPU (no AVX512-BF16/AMX): bf16 variants skipped")
    rows = []
    for name, make in variants(ours, ref, device).items():
        if (args.only and not any(o in name for o in args.only)) or (slow_bf16 and "bf16" in name):
            continue
        fn = make()
        seconds = common.time_it(lambda fn=fn: fn(z), device, args.repeats)
        cos = cosine(fn(z).float(), exact)
        dtype = torch.bfloat16 if "bf16" in name else torch.float32
        rows.append([name, seconds, flops / seconds, flops / seconds / rates[dtype], cos])
        print(f"  {name:28s} {seconds:7.2f} s  cos {cos:.6f}", flush=True)
        del fn
    _report(rows, args)
    if args.memory:
        _memory(args)


def _report(rows: list, args: argparse.Namespace) -> None:
    peers = [r for r in rows if r[0].startswith("diffusers")]
    best = min(peers, key=lambda r: r[1]) if peers else None
    print(
        f"\n| variant | median s | vs {best[0] if best else '-'} | TFLOP/s | of GEMM rate | cos vs fp32 |"
    )
    print("|---|---|---|---|---|---|")
    for name, seconds, rate, frac, cos in rows:
        ratio = f"{best[1] / seconds:.2f}x" if best else "-"
        print(f"| {name} | {seconds:.2f} | {ratio} | {rate / 1e12:.3f} | {frac:.0%} | {cos:.6f} |")


def _memory(args: argparse.Namespace) -> None:
    print(
        f"\npeak memory of one {args.size}x{args.size} decode (fresh process each, weights excluded):"
    )
    print("| variant | peak MiB | cos vs exact fp32 |")
    print("|---|---|---|")
    slow_bf16 = args.device == "cpu" and not cpu_has_fast_bf16() and not args.force_bf16
    for name in VARIANT_NAMES:
        if (args.only and not any(o in name for o in args.only)) or (slow_bf16 and "bf16" in name):
            continue
        child = ["flux", "--size", str(args.size), "--child", name, "--device", args.device]
        if args.threads:
            child += ["--threads", str(args.threads)]
        if args.no_cos:
            child.append("--no-cos")
        result = common.peak_rss_child("bench", child)
        cos = f"{result['cos']:.6f}" if "cos" in result else "-"
        print(f"| {name} | {result['peak_bytes'] / 2**20:.0f} | {cos} |", flush=True)


def _child(args, ours, ref, z, device) -> None:
    fn = variants(ours, ref, device)[args.child]()
    fn(z[..., :8, :8])  # build lazily-created state outside the measurement
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(z)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        common.reset_peak_rss()
        base = common.rss_bytes()
        out = fn(z)
        peak = common.peak_rss_bytes() - base
    result = {"variant": args.child, "peak_bytes": peak}
    if "banded" in args.child and not args.no_cos:  # the memory-saving path: still the same decode
        result["cos"] = cosine(out.float(), ours.decode(z))
    print(json.dumps(result))


# --- the row of ``python -m bench all`` (bench/table.py) ------------------------------------
def table_setup(scale: str) -> table.Setup:
    """FLUX.1 at ``scale``: diffusers' fp32, fp32+CL and bf16+CL settings, and the served path."""
    size = {"tiny": 32, "quick": 256, "full": 512}[scale]  # at 128 per-call costs dominate
    ours, ref = build()
    z = torch.randn(1, 16, size // 8, size // 8, generator=torch.Generator().manual_seed(1))
    v = variants(ours, ref, table.CPU)
    peers = {k: v[f"diffusers {k}"] for k in ("fp32", "fp32+CL", "bf16+CL")}
    return table.Setup(
        f"FLUX.1 {size}x{size}",
        {k: (lambda make=make: table.bind(make(), z)) for k, make in peers.items()},
        table.served_path(ours, lambda m: m.decode(z)),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--memory-only", action="store_true", help="peaks only, no timing")
    parser.add_argument("--no-cos", action="store_true", help="skip the banded output check")
    parser.add_argument("--only", nargs="*", help="substrings of variant names to run")
    parser.add_argument("--force-bf16", action="store_true", help="run bf16 even when slow")
    parser.add_argument("--child", help=argparse.SUPPRESS)


if __name__ == "__main__":
    sys.exit("run as: python -m bench flux ...")
