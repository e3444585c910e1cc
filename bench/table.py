"""Every family in one table: the service's served path vs diffusers' best setting here.

    python -m bench all [--quick] [--repeats 2] [--threads N] [--only FAMILY ...] [--force-bf16]
                        [--float32] [--encode]

One row per family. diffusers is measured as a user would set it up (float32, float32 with
channels_last where its convs take it, bf16) and its fastest setting is the row's peer; bf16
is skipped when this machine's bf16 GEMM runs below 1/4 of float32's (emulated, as on AVX2
CPUs), and the row says so. The service side is what ``VAE_DTYPE=auto`` serves on this
device (every candidate mode timed on the gate's probe, the fastest that passes the gate:
``app/runtime/selection.py``), decoded with the service's default options; the row says why
that mode won and each candidate's probe time. The cosine is the served output's against diffusers float32's.
``--float32`` keeps both sides to float32 (the service's float32 fast and exact modes,
diffusers' float32 settings): what a CPU whose bf16 runs slower than its float32 (issue 29's
Intel class) serves, measured at this CPU's rates.

Each family runs in its own subprocess (its models are freed before the next family loads);
inside it the variants share the family's seeded weights (built once by the family's bench
module: ``build_ours`` / ``build_peer`` / ``variants``) and each is timed with
``common.interleaved``: one warm-up decode each, then ``--repeats`` rounds in which every
variant decodes once in turn (the median per variant), so a load change hits them alike.
``--quick`` uses small shapes (the whole table in a few minutes on 2 cores); the default
shapes are the family benches' defaults. MiniMax-H3's row is one ViT3D block over one tile
clip (``bench.minimax_h3``: its decoder is 36 of them), compared on the block's update.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from app.config import Settings
from app.families.decoder import VAEDecoder
from app.families.ops import cosine
from app.runtime import gate, modes, selection
from bench import common

Decode = Callable[[], torch.Tensor]
Choose = Callable[[VAEDecoder], modes.Mode]  # the mode a served copy is built in
CPU = torch.device("cpu")
MIN_COS = Settings.model_fields["parity_min_cos"].default
SCALES = ("tiny", "quick", "full")


@dataclass
class Setup:
    """One family at one shape: what to decode, diffusers' settings and the served path."""

    shape: str
    peers: dict[str, Callable[[], Decode]]  # setting -> make() -> decode(), built lazily
    served: Callable[[Choose], tuple[str, Decode, int]]  # make(choose) -> (mode, decode(), own)


# how the served mode was chosen (this process measures one family): why, candidate times
SELECTION: dict = {}


def served_mode(reference: VAEDecoder, float32_only: bool = False) -> modes.Mode:
    """What ``VAE_DTYPE=auto`` serves on this machine's CPU: the service's own measurement
    (app/runtime/selection.py: every candidate mode timed on the gate's probe, the fastest
    that passes the gate), recorded in ``SELECTION`` for the row. ``float32_only``: its
    float32 candidates alone, as a CPU whose bf16 loses to its float32 serves."""
    probes = gate.probes_for(reference)
    candidates = modes.candidate_modes("auto", CPU)
    if float32_only:
        candidates = [m for m in candidates if m.dtype == torch.float32]
    chosen = selection.choose(reference.family, probes, CPU, candidates, MIN_COS)
    SELECTION.update(
        why=chosen.why,
        gate_cos=chosen.chosen.report.cosine if chosen.chosen.report else None,
        candidates={str(c.mode): c.probe_seconds for c in chosen.candidates},
    )
    return chosen.chosen.mode


def _served(
    reference: torch.nn.Module, decode: Callable
) -> Callable[[Choose], tuple[str, Decode, int]]:
    def make(choose: Choose) -> tuple[str, Decode, int]:
        mode = choose(reference)
        model = modes.build(reference, CPU, mode)
        return str(mode), lambda: decode(model), common.own_bytes(model, reference)

    return make


def _bind(fn: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor) -> Decode:
    return lambda: fn(z)


def _once(build: Callable):
    """``build`` called at most once: the variants of a family share its weights."""
    held = []

    def get():
        if not held:
            held.append(build())
        return held[0]

    return get


# --- families: each reuses its bench module's builders -------------------------------------
def flux(scale: str) -> Setup:
    from bench import flux as b

    size = {"tiny": 32, "quick": 256, "full": 512}[scale]  # at 128 per-call costs dominate
    ours, ref = b.build()
    z = torch.randn(1, 16, size // 8, size // 8, generator=torch.Generator().manual_seed(1))
    v = b.variants(ours, ref, CPU)
    peers = {k: v[f"diffusers {k}"] for k in ("fp32", "fp32+CL", "bf16+CL")}
    return Setup(
        f"FLUX.1 {size}x{size}",
        {k: (lambda make=make: _bind(make(), z)) for k, make in peers.items()},
        _served(ours, lambda m: m.decode(z)),
    )


def _video(
    variants: dict, names: dict[str, str], build, z: torch.Tensor, shape: str, options
) -> Setup:
    """A family whose bench module has ``variants(..., build) -> name -> make(device)``."""
    peers = {k: (lambda name=name: _bind(variants[name](CPU), z)) for k, name in names.items()}
    return Setup(shape, peers, _served(build(), lambda m: m.decode(z, **options)))


PEER_NAMES = {
    "fp32": "diffusers fp32",
    "fp32+CL3d": "diffusers fp32+CL3d",
    "bf16": "diffusers bf16",
}


def ltx(scale: str) -> Setup:
    from bench import ltx as b

    frames, size = {"tiny": (1, 32), "quick": (2, 128), "full": (3, 256)}[scale]
    build = _once(b.build_ours)
    z = b.latent(frames, size)
    shape = f"0.9.1, {build().frames_out(frames)}x{size}x{size}"
    opts = {"timestep": b.TIMESTEP, "seed": b.SEED}
    return _video(b.variants(1, build), PEER_NAMES, build, z, shape, opts)


def wan(scale: str) -> Setup:
    from bench import wan as b

    frames, size = {"tiny": (1, 32), "quick": (2, 128), "full": (3, 256)}[scale]
    build = _once(lambda: b.build_ours("wan2.1"))
    z = b.latent("wan2.1", frames, size)
    shape = f"2.1, {build().frames_out(frames)}x{size}x{size}"
    return _video(b.variants("wan2.1", 1, build), PEER_NAMES, build, z, shape, {})


def hunyuan_video(scale: str) -> Setup:
    from bench import hunyuan_video as b

    frames, size = {"tiny": (1, 16), "quick": (2, 64), "full": (5, 256)}[scale]
    build = _once(b.build_ours)
    z = b.latent(frames, size)
    shape = f"{build().frames_out(frames)}x{size}x{size}"
    args = argparse.Namespace(tiled=False)
    return _video(b.variants(args, build), PEER_NAMES, build, z, shape, {})


def ltx2(scale: str) -> Setup:
    from bench import ltx2 as b

    # the released architecture (a tiny one decodes in milliseconds: per-call costs only)
    frames, size = {"tiny": (2, 2), "quick": (2, 4), "full": (3, 8)}[scale]
    ours = b.build_ours(config=None if scale == "tiny" else b.RELEASED)
    z = b.latent(ours, frames, size)

    def peer(dtype: torch.dtype, channels_last: bool) -> Callable[[], Decode]:
        def make() -> Decode:
            ref = b.build_peer(ours).to(dtype=dtype)
            if channels_last:
                ref = ref.to(memory_format=torch.channels_last_3d)
            return lambda: b.peer_decode(ref, z)

        return make

    px = size * ours.spatial_scale
    arch = "ltx2-tiny arch" if scale == "tiny" else "LTX-2"
    return Setup(
        f"{arch}, {ours.frames_out(frames)}x{px}x{px}",
        {
            "fp32": peer(torch.float32, False),
            "fp32+CL3d": peer(torch.float32, True),
            "bf16": peer(torch.bfloat16, False),
        },
        _served(ours, lambda m: m.decode(z, timestep=b.TIMESTEP, seed=b.SEED)),
    )


def minimax_h3(scale: str) -> Setup:
    from bench import minimax_h3 as b

    decoder = b.build(1)
    cfg = decoder.config
    dim = cfg["decoder_num_attention_heads"] * cfg["decoder_attention_head_dim"]
    n = b.tokens(cfg) if scale != "tiny" else 64
    x = torch.randn(1, n, dim, generator=torch.Generator().manual_seed(1))
    grid = b.GRID if scale != "tiny" else None
    ours_rope = decoder.rope(b.GRID, CPU)
    theirs_rope = b.peer_rope(cfg, CPU)
    if grid is None:  # the tiny test shape: the rope tables cut to n tokens
        ours_rope = tuple(t[:n] for t in ours_rope)
        theirs_rope = tuple(t[:, :n] for t in theirs_rope)

    def update(fn: Decode) -> Decode:
        return lambda: fn() - x  # a block's residual update: the output minus its input

    def peer(dtype: torch.dtype) -> Callable[[], Decode]:
        def make() -> Decode:
            model = decoder if dtype == torch.float32 else copy.deepcopy(decoder).to(dtype)
            blocks = b.peer_blocks(model.decoder.transformer_blocks, cfg)
            return update(b.stack(blocks, x, theirs_rope))  # x float32, as the bench

        return make

    def served(choose: Choose) -> tuple[str, Decode, int]:
        mode = choose(decoder)
        model = modes.build(decoder, CPU, mode)
        decode = update(b.stack(model.decoder.transformer_blocks, x, ours_rope))
        return str(mode), decode, common.own_bytes(model, decoder)

    return Setup(
        f"1 ViT3D block, {n} tokens",
        {"fp32": peer(torch.float32), "bf16": peer(torch.bfloat16)},
        served,
    )


def taesd(scale: str) -> Setup:
    from bench import taesd as b

    size = {"tiny": 32, "quick": 256, "full": 512}[scale]
    ours, ref = b.build_pair()
    z = torch.randn(1, 16, size // 8, size // 8, generator=torch.Generator().manual_seed(1))

    def peer(dtype: torch.dtype, channels_last: bool) -> Callable[[], Decode]:
        def make() -> Decode:
            model = copy.deepcopy(ref).to(dtype=dtype)
            if channels_last:
                model = model.to(memory_format=torch.channels_last)
            # diffusers returns [-1, 1]; the service (as upstream TAESD) [0, 1]
            return lambda: (model.decode(z.to(dtype)).sample + 1) / 2

        return make

    return Setup(
        f"TAEF1-shape {size}x{size}",
        {
            "fp32": peer(torch.float32, False),
            "fp32+CL": peer(torch.float32, True),
            "bf16+CL": peer(torch.bfloat16, True),
        },
        _served(ours, lambda m: m.decode(z)),
    )


FAMILIES: dict[str, Callable[[str], Setup]] = {
    "flux": flux,
    "ltx": ltx,
    "ltx2": ltx2,
    "minimax-h3": minimax_h3,
    "wan": wan,
    "hunyuan-video": hunyuan_video,
    "taesd": taesd,
}
EMULATED = "skipped: bf16 emulated"
NOT_ASKED = "skipped: --float32"
SERVED = "served"


# --- measuring one family -----------------------------------------------------------------
@torch.inference_mode()
def measure(
    family: str, scale: str, repeats: int, skip_bf16: bool, float32_only: bool = False
) -> dict:
    """One row: every diffusers setting's median seconds (or why it was skipped), the
    fastest of them, the served path's median seconds and its cosine against diffusers fp32
    (``float32_only``: both sides in float32)."""
    setup = FAMILIES[family](scale)
    peers: dict[str, float | str] = {}
    decodes = {}
    for setting, make in setup.peers.items():
        if float32_only and "bf16" in setting:
            peers[setting] = NOT_ASKED
        elif skip_bf16 and "bf16" in setting:
            peers[setting] = EMULATED
        else:
            decodes[setting] = make()
    choose = partial(served_mode, float32_only=float32_only)
    mode, decodes[SERVED], own = setup.served(choose)
    outputs = {name: fn().float() for name, fn in decodes.items()}  # also the warm-ups
    times = common.interleaved(decodes, CPU, repeats)  # a load change hits every variant
    seconds = times.pop(SERVED)
    peers.update(times)
    reference = outputs.get("fp32")
    cos = cosine(outputs[SERVED], reference) if reference is not None else float("nan")
    timed = {k: v for k, v in peers.items() if isinstance(v, float)}
    best = min(timed, key=timed.get)
    return {
        "family": family,
        "shape": setup.shape,
        "peers": peers,
        "best": best,
        "best_s": timed[best],
        "served": mode,
        "service_s": seconds,
        "own_mib": own / 2**20,
        "ratio": timed[best] / seconds,
        "cos": cos,
        "served_why": SELECTION.get("why"),
        "gate_cos": SELECTION.get("gate_cos"),
        "candidates": SELECTION.get("candidates"),
    }


# --- the machine and the table -------------------------------------------------------------
def cpu_flags() -> dict[str, bool]:
    """The instruction sets that decide bf16's speed, from /proc/cpuinfo."""
    try:
        flags = set(
            next(
                line.split(":", 1)[1].split()
                for line in open("/proc/cpuinfo")
                if line.startswith("flags")
            )
        )
    except (OSError, StopIteration):
        flags = set()
    return {
        "AVX2": "avx2" in flags,
        "AVX-512-BF16": "avx512_bf16" in flags,
        "AMX": bool({"amx_bf16", "amx_tile"} & flags),
    }


def machine_line() -> str:
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu_flags().items())
    return f"machine: {common.machine()}; {flags}"


def format_table(rows: list[dict]) -> str:
    lines = [
        "| family | shape | diffusers' best | its s | service s (served mode) | vs best "
        "| served copy's own MiB | cos vs diffusers fp32 | diffusers settings measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | - | - | - | - | - | - | - | failed: {r['error']} |")
            continue
        settings = "; ".join(
            f"{k} {v:.2f} s" if isinstance(v, float) else f"{k} {v}" for k, v in r["peers"].items()
        )
        lines.append(
            f"| {r['family']} | {r['shape']} | {r['best']} | {r['best_s']:.2f} "
            f"| {r['service_s']:.2f} ({r['served']}) | {r['ratio']:.2f}x | {r['own_mib']:.0f} "
            f"| {r['cos']:.7f} "
            f"| {settings} |"
        )
    lines += [_why_line(r) for r in rows if r.get("candidates")]
    return "\n".join(lines)


def _why_line(row: dict) -> str:
    """Why the served mode won: each candidate's best probe time (the gate's probe)."""
    times = ", ".join(
        f"{mode} {'-' if t is None else f'{t:.3f} s'}" for mode, t in row["candidates"].items()
    )
    return f"\n{row['family']}: served {row['served']} ({row['served_why']}); probe: {times}"


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    scale = "quick" if args.quick else args.scale
    if args.child:
        row = measure(args.child, scale, args.repeats, args.skip_bf16, args.float32)
        return print(json.dumps(row))
    print(machine_line())
    rates = {d: common.gemm_rate(d, CPU) for d in (torch.float32, torch.bfloat16)}
    emulated = rates[torch.bfloat16] < rates[torch.float32] / 4
    print(
        "GEMM rate: "
        + ", ".join(f"{str(d)[6:]} {r / 1e9:.0f} GFLOP/s" for d, r in rates.items())
        + ("  (bf16 emulated: its diffusers settings skipped)" if emulated else "")
    )
    rows = []
    for family in args.only or FAMILIES:
        command = [sys.executable, "-m", "bench", "all", "--child", family, "--scale", scale]
        command += ["--repeats", str(args.repeats)]
        if args.threads:
            command += ["--threads", str(args.threads)]
        if emulated and not args.force_bf16:
            command.append("--skip-bf16")
        if args.float32:
            command.append("--float32")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            rows.append({"family": family, "error": last[:200]})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        note = r.get("error") or f"{r['ratio']:.2f}x of diffusers {r['best']}"
        print(f"  {family:14s} {note}", flush=True)
    print()
    print(format_table(rows))
    if args.encode:
        from bench import encode

        options = argparse.Namespace(**{**vars(args), "only": None})
        print(f"\nencoders (load average {' / '.join(f'{v:.1f}' for v in os.getloadavg())})")
        print(encode.format_table(encode.rows(options, emulated)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small shapes (= --scale quick)")
    parser.add_argument("--scale", choices=SCALES, default="full", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--only", nargs="*", choices=list(FAMILIES), help="families to run")
    parser.add_argument("--force-bf16", action="store_true", help="run bf16 even when emulated")
    parser.add_argument("--skip-bf16", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--float32",
        action="store_true",
        help="float32 on both sides: what a CPU whose bf16 runs slower than float32 serves",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--encode", action="store_true", help="append the encoders' table")


if __name__ == "__main__":
    sys.exit("run as: python -m bench all ...")
