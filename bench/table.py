"""Every family in one table: the service's served path vs diffusers' best setting here.

    python -m bench all [--quick] [--repeats 2] [--threads N] [--only ROW ...] [--force-bf16]
                        [--float32] [--encode]

The rows come from the family descriptors (``app.families``): each entry of a family's
``bench`` (row name -> bench module) is a row whose setup is that module's own
``table_setup(scale) -> Setup``; a family without one still gets a row, its served path alone
(``served_only``: its first embedded model, seeded, decoding its gate probe latent) with no
diffusers peer, so a new family is benched without bench code.

diffusers is measured as a user would set it up (float32, float32 with channels_last where its
convs take it, bf16) and its fastest setting is the row's peer; bf16 is skipped when this
machine's bf16 GEMM runs below 1/4 of float32's (emulated, as on AVX2 CPUs), and the row says
so. The service side is what ``VAE_DTYPE=auto`` serves on this device (every candidate mode
timed on the gate's probe, the fastest that passes the gate: ``app/runtime/selection.py``),
decoded with the service's default options; the row says why that mode won and each
candidate's probe time. The cosine is the served output's against diffusers float32's.
``--float32`` keeps both sides to float32 (the service's float32 fast and exact modes,
diffusers' float32 settings): what a CPU whose bf16 runs slower than its float32 (issue 29's
Intel class) serves, measured at this CPU's rates.

Each row runs in its own subprocess (its models are freed before the next row loads); inside
it the variants share the family's seeded weights (built once by the bench module's
``table_setup``) and each is timed with ``common.interleaved``: one warm-up decode each, then
``--repeats`` rounds in which every variant decodes once in turn (the median per variant), so
a load change hits them alike. ``--quick`` uses small shapes (the whole table in a few minutes
on 2 cores); the default shapes are the family benches' defaults. MiniMax-H3's row is one
ViT3D block over one tile clip (``bench.minimax_h3``: its decoder is 36 of them), compared on
the block's update.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from app.config import Settings
from app.families import families, family
from app.families.decoder import VAEDecoder
from app.families.ops import cosine
from app.runtime import gate, modes, selection
from bench import common

Decode = Callable[[], torch.Tensor]
Choose = Callable[[VAEDecoder], modes.Mode]  # the mode a served copy is built in
CPU = torch.device("cpu")
MIN_COS = Settings.model_fields["parity_min_cos"].default
SCALES = ("tiny", "quick", "full")
NO_PEER = "no peer"  # a row of a family without a bench module: its served path alone


@dataclass
class Setup:
    """One row at one shape: what to decode, diffusers' settings and the served path."""

    shape: str
    # setting -> make() -> decode(), built lazily; empty: no peer (``served_only``)
    peers: dict[str, Callable[[], Decode]]
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


def served_path(
    reference: torch.nn.Module, decode: Callable
) -> Callable[[Choose], tuple[str, Decode, int]]:
    """``Setup.served``: the copy of ``reference`` in the chosen mode, ``decode(copy)`` timed."""

    def make(choose: Choose) -> tuple[str, Decode, int]:
        mode = choose(reference)
        model = modes.build(reference, CPU, mode)
        return str(mode), lambda: decode(model), common.own_bytes(model, reference)

    return make


def bind(fn: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor) -> Decode:
    return lambda: fn(z)


def once(build: Callable):
    """``build`` called at most once: the variants of a family share its weights."""
    held = []

    def get():
        if not held:
            held.append(build())
        return held[0]

    return get


def video(
    variants: dict, names: dict[str, str], build, z: torch.Tensor, shape: str, options
) -> Setup:
    """A family whose bench module has ``variants(..., build) -> name -> make(device)``."""
    peers = {k: (lambda name=name: bind(variants[name](CPU), z)) for k, name in names.items()}
    return Setup(shape, peers, served_path(build(), lambda m: m.decode(z, **options)))


PEER_NAMES = {  # the video benches' diffusers variants, by the table's setting names
    "fp32": "diffusers fp32",
    "fp32+CL3d": "diffusers fp32+CL3d",
    "bf16": "diffusers bf16",
}


# --- the rows, from the family descriptors ---------------------------------------------------
def setups() -> dict[str, Callable[[str], Setup]]:
    """Row name -> setup(scale): each family's bench modules' ``table_setup``, or its served
    path alone where it has none. Read at call time: a family registered since is a row."""
    rows: dict[str, Callable[[str], Setup]] = {}
    for key, described in families().items():
        for row, module in described.bench.items():
            rows[row] = partial(_module_setup, module)
        if not described.bench:
            rows[key] = partial(served_only, key)
    return rows


def _module_setup(module: str, scale: str) -> Setup:
    # imported only here: the bench modules import diffusers (a test extra)
    return importlib.import_module(module).table_setup(scale)


def served_only(key: str, scale: str) -> Setup:
    """A family with no bench module: its first embedded model (seeded, as ``bake
    --synthetic`` writes it) decoding its gate probe latent, the run the mode selection times.
    No peer, so no ratio; the probe's size is the family's, whatever the ``scale``."""
    described = family(key)
    if not described.synthetic:
        raise ValueError(f"family {key!r} embeds no model to bench (no synthetic recipe)")
    name, recipe = next(iter(described.synthetic.items()))
    reference = described.decoder.module(dict(recipe.config)).eval()
    described.decoder.init_synthetic(reference, torch.Generator().manual_seed(0))
    reference.requires_grad_(False)
    probes = gate.probes_for(reference)
    shape = f"{name}, probe {'x'.join(map(str, probes.plain.shape))}"
    return Setup(shape, {}, served_path(reference, lambda m: probes.run_plain(m)))


EMULATED = "skipped: bf16 emulated"
NOT_ASKED = "skipped: --float32"
SERVED = "served"


# --- measuring one row ---------------------------------------------------------------------
@torch.inference_mode()
def measure(
    row: str, scale: str, repeats: int, skip_bf16: bool, float32_only: bool = False
) -> dict:
    """One row: every diffusers setting's median seconds (or why it was skipped), the
    fastest of them, the served path's median seconds and its cosine against diffusers fp32
    (``float32_only``: both sides in float32). A row without a peer has no best, ratio or
    cosine (None)."""
    setup = setups()[row](scale)
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
    timed = {k: v for k, v in peers.items() if isinstance(v, float)}
    best = min(timed, key=timed.get) if timed else None
    return {
        "family": row,
        "shape": setup.shape,
        "peers": peers,
        "best": best or NO_PEER,
        "best_s": timed.get(best),
        "served": mode,
        "service_s": seconds,
        "own_mib": own / 2**20,
        "ratio": timed[best] / seconds if best else None,
        "cos": cosine(outputs[SERVED], reference) if reference is not None else None,
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
            f"| {r['family']} | {r['shape']} | {r['best']} | {_num(r['best_s'], '.2f')} "
            f"| {r['service_s']:.2f} ({r['served']}) | {_num(r['ratio'], '.2f', 'x')} "
            f"| {r['own_mib']:.0f} | {_num(r['cos'], '.7f')} "
            f"| {settings or 'none (no bench module)'} |"
        )
    lines += [_why_line(r) for r in rows if r.get("candidates")]
    return "\n".join(lines)


def _num(x: float | None, spec: str, unit: str = "") -> str:
    """A number of the table, blank where the row has none (no peer: no ratio, no cosine)."""
    return "" if x is None else f"{x:{spec}}{unit}"


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
    for name in args.only or setups():
        command = ["all", "--child", name, "--scale", scale]
        command += ["--repeats", str(args.repeats)]
        if args.threads:
            command += ["--threads", str(args.threads)]
        if emulated and not args.force_bf16:
            command.append("--skip-bf16")
        if args.float32:
            command.append("--float32")
        rows.append({"family": name, **common.bench_child(command)})
        print(f"  {name:14s} {_note(rows[-1])}", flush=True)
    print()
    print(format_table(rows))
    if args.encode:
        from bench import encode

        options = argparse.Namespace(**{**vars(args), "only": None})
        print(f"\nencoders (load average {' / '.join(f'{v:.1f}' for v in os.getloadavg())})")
        print(encode.format_table(encode.rows(options, emulated)))


def _note(row: dict) -> str:
    if "error" in row:
        return row["error"]
    if row["ratio"] is None:
        return f"served {row['served']} {row['service_s']:.2f} s ({NO_PEER})"
    return f"{row['ratio']:.2f}x of diffusers {row['best']}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small shapes (= --scale quick)")
    parser.add_argument("--scale", choices=SCALES, default="full", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--only", nargs="*", choices=list(setups()), help="rows to run")
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
