"""Timing, GEMM rate, FLOP counting and peak-memory helpers shared by the benchmarks."""

from __future__ import annotations

import copy
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    bmm_flop,
    conv_flop_count,
    register_flop_formula,
)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, {gpu}, torch {torch.__version__}"


def channels_last_3d(module: torch.nn.Module) -> torch.nn.Module:
    """``module.to(memory_format=torch.channels_last_3d)`` for a model that also holds 4-D
    weights (that call refuses them): only its 5-D parameters change layout."""
    for param in module.parameters():
        if param.dim() == 5:
            param.data = param.data.contiguous(memory_format=torch.channels_last_3d)
    return module


def own_bytes(copy: torch.nn.Module, reference: torch.nn.Module) -> int:
    """Bytes of ``copy``'s parameters and buffers that are not ``reference``'s storage: what
    serving the copy adds to a process that holds the reference (a float32 CPU copy shares
    the reference's weights; fast paths add their own tensors, e.g. Winograd operands)."""
    tensors = (*reference.parameters(), *reference.buffers())
    seen = {t.untyped_storage().data_ptr() for t in tensors}
    total = 0
    for t in (*copy.parameters(), *copy.buffers()):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_it(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(fns: dict, device: torch.device, repeats: int) -> dict[str, float]:
    """Median seconds of each callable, the variants taking turns in every round, so a
    load change on a shared machine lands on all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(time_it(fn, device, repeats=1, warmup=0))
    return {name: statistics.median(values) for name, values in samples.items()}


def gemm_rate(dtype: torch.dtype, device: torch.device, n: int = 2048) -> float:
    """Measured GEMM FLOP/s for square n x n matrices (the machine's practical ceiling).

    A 512 probe first: an emulated dtype (bf16 on an AVX2 CPU) would take minutes at 2048."""
    probe = _gemm(dtype, device, 512, repeats=2)
    return probe if probe < 20e9 else _gemm(dtype, device, n, repeats=5)


def _gemm(dtype: torch.dtype, device: torch.device, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = time_it(lambda: a @ b, device, repeats=repeats, warmup=1)
    return 2 * n**3 / seconds


@register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """The CPU flash kernel's q k^T and p v (FlopCounterMode counts only the GPU kernels)."""
    b, h, n, d = query
    return 4 * b * h * n * key[-2] * d


@register_flop_formula(torch.ops.aten.slow_conv3d_forward)
def _im2col_conv3d_flops(x, weight, kernel, bias, stride, padding, *, out_shape) -> int:
    """``ops.conv3d_direct``'s im2col + GEMM conv (the counter knows only ``convolution``)."""
    return conv_flop_count(x, weight, out_shape, transposed=False)


@register_flop_formula(torch.ops.aten.baddbmm_)
def _inplace_baddbmm_flops(self, a, b, *args, out_shape=None, **kwargs) -> int:
    """Winograd's accumulating GEMMs (``winograd.py``)."""
    return bmm_flop(a, b)


def count_flops(fn: Callable[[], object]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def meta_flops(decoder: torch.nn.Module, shape: tuple[int, ...]) -> int:
    """FLOPs of one decode, counted on the meta device: shapes only, no arithmetic."""
    meta = copy.deepcopy(decoder).to("meta")
    return count_flops(lambda: meta.decode(torch.empty(shape, device="meta")))


def peak_rss_child(module: str, args: list[str]) -> dict:
    """Run ``python -m module args`` and return its JSON line (it reports its own peak)."""
    out = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss_bytes() -> int:
    from app.runtime import host_memory

    return host_memory.resident()


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark (VmHWM) so the next peak is the decode's alone."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def compare_outputs(rows: list[dict], outputs: dict, peer: str) -> None:
    """Add each row's cosine and max-abs error against the ``peer`` variant's saved output."""
    from app.families.ops import cosine

    if peer not in outputs:
        return
    expected = torch.load(outputs[peer])
    for row in rows:
        if (path := outputs.get(row["variant"])) is not None:
            got = torch.load(path)
            row["cos"] = cosine(got, expected)
            row["max_abs"] = (got - expected).abs().max().item()


def print_report(rows: list[dict], flops: int, rates: dict, device: str, peer: str) -> None:
    """One markdown row per variant: time, ratio to diffusers' best, FLOP rate, peak, parity."""
    peers = [r for r in rows if r["variant"].startswith("diffusers")]
    best = min(peers, key=lambda r: r["seconds"]) if peers else None
    where = "CUDA max_memory_allocated" if device == "cuda" else "VmHWM above the loaded model"
    print(
        f"\n| variant | median s | vs {best['variant'] if best else '-'} | TFLOP/s "
        f"| of GEMM rate | peak MiB ({where}) | cos vs {peer} | max-abs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        dtype = torch.bfloat16 if "bf16" in r["variant"] else torch.float32
        rate = flops / r["seconds"]
        ratio = f"{best['seconds'] / r['seconds']:.2f}x" if best else "-"
        cos = f"{r['cos']:.9f}" if "cos" in r else "- (not kept)"
        err = f"{r['max_abs']:.1e}" if "max_abs" in r else "-"
        print(
            f"| {r['variant']} | {r['seconds']:.2f} | {ratio} | {rate / 1e12:.3f} "
            f"| {rate / rates[dtype]:.0%} | {r['peak_bytes'] / 2**20:.0f} | {cos} | {err} |"
        )


def bench_child(args: list[str]) -> dict:
    """``python -m bench ARGS`` (a ``--child`` run) in a process of its own: its JSON line, or
    ``{"error": the last line it wrote to stderr}`` when it failed."""
    done = subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def spawn_child(family: str, args, options: list[str], name: str, out: Path) -> dict:
    """Variant ``name`` of ``python -m bench <family>`` measured in a process of its own
    (``--child``; ``options``: the family's own arguments); the child's JSON result."""
    command = [sys.executable, "-m", "bench", family, "--child", name, "--out", str(out)]
    command += [*options, "--repeats", str(args.repeats), "--device", args.device]
    if args.threads:
        command += ["--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"variant {name!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(make: Callable, warm: torch.Tensor, z: torch.Tensor, args) -> None:
    """One variant in this child process: ``make(device)`` (its build timed), one decode of
    the small ``warm`` latent (lazily created state stays outside the timing), then
    ``measure_child`` on ``z``."""
    device = torch.device(args.device)
    t0 = time.perf_counter()
    decode = make(device)
    build_s = time.perf_counter() - t0
    decode(warm)
    measure_child(decode, z, device, args, build_s)


def measure_child(
    decode: Callable, z: torch.Tensor, device: torch.device, args, build_s: float
) -> None:
    """A benchmark child's measurement: ``args.repeats`` decodes of ``z`` (median time), the
    peak memory above what the process held before them, the last output saved to
    ``args.out``; one JSON line on stdout for the parent."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()
        base = rss_bytes()
    times, out = [], None
    for _ in range(args.repeats):
        out = None  # the previous output is not part of the next decode's peak
        t1 = time.perf_counter()
        out = decode(z)
        sync(device)
        times.append(time.perf_counter() - t1)
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else peak_rss_bytes()) - base
    if out is not None:
        torch.save(out.float().cpu(), args.out)
    result = {
        "variant": args.child,
        "seconds": statistics.median(times),
        "times": times,
        "peak_bytes": peak,
        "build_s": build_s,
    }
    print(json.dumps(result))


def run_children(
    names: list[str],
    only: list[str] | None,
    skip_bf16: bool,
    spawn: Callable[[str, Path], dict],
    flops: int,
    rates: dict,
    device: str,
    peer: str,
) -> None:
    """Run each selected variant in its own process (``spawn(name, output_path)``), print its
    line as it finishes, then the table with every output compared with ``peer``'s."""
    import tempfile

    selected = [
        n
        for n in names
        if not (only and not any(o in n for o in only)) and not (skip_bf16 and "bf16" in n)
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        outputs: dict[str, Path] = {}
        for name in selected:
            out = Path(tmp) / f"{len(outputs)}.pt"
            result = spawn(name, out)
            if out.exists():
                outputs[name] = out
            rows.append(result)
            print(
                f"  {name:26s} {result['seconds']:8.2f} s  peak "
                f"{result['peak_bytes'] / 2**20:7.0f} MiB  (build {result['build_s']:.0f} s)",
                flush=True,
            )
        compare_outputs(rows, outputs, peer)
    print_report(rows, flops, rates, device, peer)
