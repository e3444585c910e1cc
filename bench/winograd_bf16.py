"""Winograd convolutions in bf16 (issue 29): how far each rounding takes a conv from float32.

    python -m bench winograd-bf16 [--channels 256] [--size 128] [--repeats 3]

Part 1, precision (no timing, the same on any CPU): one seeded 3x3 conv computed by Winograd
in float64 with explicit transform matrices, F(2x2, 3x3) and F(4x4, 3x3), each time rounding
one of its quantities to bf16 (the input, the weight, the transformed weight ``U``, the
transformed input ``V``, the GEMMs' product ``M``, or all of them: what a bf16 Winograd with
bf16 GEMM operands and outputs does, since PyTorch's CPU ``bmm`` has no float32-out form for
bf16 operands), against a float64 direct conv: 1 - cosine per case, beside a bf16 direct conv
(oneDNN) rounded the same way at its input, weight and output.

Part 2, speed (this machine): ``app.families.winograd.conv3x3`` run on bf16 tensors (every
buffer and GEMM in bf16) against oneDNN's bf16 direct conv, channels-last, best of
``--repeats``, with each one's 1 - cosine against float64.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from app.families import winograd
from bench.common import machine

# (B^T, G, A^T) of F(m x m, 3 x 3): input tile m + 2, output tile m
TRANSFORMS = {
    "F(2x2,3x3)": (
        [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
        [[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]],
        [[1, 1, 1, 0], [0, 1, -1, -1]],
    ),
    "F(4x4,3x3)": (
        [
            [4, 0, -5, 0, 1, 0],
            [0, -4, -4, 1, 1, 0],
            [0, 4, -4, -1, 1, 0],
            [0, -2, -1, 2, 1, 0],
            [0, 2, -1, -2, 1, 0],
            [0, 4, 0, -5, 0, 1],
        ],
        [list(row) for row in winograd._G],
        [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]],
    ),
}
ROUNDED = ("input", "weight", "U", "V", "M")


def _bf16(t: torch.Tensor, on: bool) -> torch.Tensor:
    return t.to(torch.bfloat16).double() if on else t


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def winograd_f64(x: torch.Tensor, w: torch.Tensor, name: str, rounded: set[str]) -> torch.Tensor:
    """``conv2d(x, w, padding=1)`` by Winograd ``name`` in float64, ``rounded`` quantities in
    bf16 (``x`` ``[1, c, h, w]`` with h, w multiples of the output tile)."""
    bt, g, at = (torch.tensor(m, dtype=torch.float64) for m in TRANSFORMS[name])
    tile = at.shape[0]
    d = F.pad(_bf16(x, "input" in rounded), (1, 1, 1, 1))
    d = d.unfold(2, tile + 2, tile).unfold(3, tile + 2, tile)[0]  # [c, ty, tx, n, n]
    v = _bf16(torch.einsum("ak,ctxkl,bl->abtxc", bt, d, bt), "V" in rounded)
    u = torch.einsum("ak,oikl,bl->abio", g, _bf16(w, "weight" in rounded), g)
    m = _bf16(torch.einsum("abtxc,abco->abtxo", v, _bf16(u, "U" in rounded)), "M" in rounded)
    y = torch.einsum("pa,abtxo,qb->otpxq", at, m, at)
    o, ty, _, tx, _ = y.shape
    return y.reshape(o, ty * tile, tx * tile)[None]


def precision_rows(channels: int, size: int) -> list[tuple[str, str, float]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, channels, size, size, generator=gen, dtype=torch.float64)
    w = torch.randn(channels, channels, 3, 3, generator=gen, dtype=torch.float64)
    w /= 3 * channels**0.5
    exact = F.conv2d(x, w, padding=1)
    direct = _bf16(F.conv2d(_bf16(x, True), _bf16(w, True), padding=1), True)
    rows = [("direct (oneDNN's bf16: input, weight, output)", "-", 1 - _cosine(direct, exact))]
    for name in TRANSFORMS:
        for case in ("nothing", *ROUNDED, "all"):
            rounded = set(ROUNDED) if case == "all" else {case} - {"nothing"}
            rows.append((name, case, 1 - _cosine(winograd_f64(x, w, name, rounded), exact)))
    return rows


def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def speed_row(channels: int, size: int, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, channels, size, size, generator=gen)
    w = torch.randn(channels, channels, 3, 3, generator=gen) / (3 * channels**0.5)
    exact = F.conv2d(x.double(), w.double(), padding=1)
    xb = x.bfloat16().contiguous(memory_format=torch.channels_last)
    wb = w.bfloat16().contiguous(memory_format=torch.channels_last)
    u = winograd.transform_weight(wb.float()).bfloat16()
    direct = lambda: F.conv2d(xb, wb, padding=1)  # noqa: E731
    wino = lambda: winograd.conv3x3(xb, u, None)  # noqa: E731
    return {
        "direct_ms": _best(direct, repeats) * 1e3,
        "winograd_ms": _best(wino, repeats) * 1e3,
        "direct_err": 1 - _cosine(direct(), exact),
        "winograd_err": 1 - _cosine(wino(), exact),
    }


def run(args: argparse.Namespace) -> None:
    print(f"machine: {machine()}")
    print(f"\nprecision, one conv {args.channels} ch at {args.size}x{args.size} (1 - cos):")
    print("| transform | rounded to bf16 | 1 - cos |\n|---|---|---|")
    for name, case, err in precision_rows(args.channels, args.size):
        print(f"| {name} | {case} | {err:.1e} |")
    print("\nspeed, bf16 channels-last (best of repeats):")
    print("| conv | oneDNN direct ms (1 - cos) | F(4x4) all-bf16 ms (1 - cos) | speed-up |")
    print("|---|---|---|---|")
    for c, s in ((512, 64), (256, 128), (256, 256), (128, 256), (64, 256)):
        r = speed_row(c, s, args.repeats)
        print(
            f"| {c} ch {s}x{s} | {r['direct_ms']:.0f} ({r['direct_err']:.1e}) "
            f"| {r['winograd_ms']:.0f} ({r['winograd_err']:.1e}) "
            f"| {r['direct_ms'] / r['winograd_ms']:.2f}x |"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--channels", type=int, default=256)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
