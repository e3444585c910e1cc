"""The heap (``VAE_HEAP_REUSE``): each family's served decode with glibc's defaults and with
the heap reused, side by side.

    python -m bench heap [--quick] [--only FAMILY ...] [--mode bfloat16|float32] [--repeats 2]

Each row is ``bench.table``'s setup (same rows, shapes and seeded weights), the served copy of
``--mode`` (as ``bench profile`` builds it), decoded on a second thread as the service's worker
does, in a fresh process per variant: ``glibc`` (the defaults) and ``reuse``
(``app.runtime.heap.reuse`` before anything runs). After one warm-up decode and a
``malloc_trim``: the best of ``--repeats`` decodes, the minor page faults of the last one, and
how far the resident set rose over them (the peak, ``VmHWM``, reset after the warm-up, less the
resident set before).
"""

from __future__ import annotations

import argparse
import json
import resource
import threading
import time

VARIANTS = ("glibc", "reuse")


def measure(name: str, scale: str, mode: str, repeats: int) -> dict:
    """One row in this process (its heap already set): seconds, faults, resident growth."""
    import torch

    from app.runtime import heap, modes
    from bench import common, table

    setup = table.setups()[name](scale)
    served, decode, _ = setup.served(lambda reference: modes.Mode(modes.DTYPES[mode]))
    out: dict = {"shape": setup.shape, "served": served}

    def work() -> None:
        with torch.inference_mode():
            decode()
            heap.release()
            base = common.rss_bytes()
            common.reset_peak_rss()  # VmHWM from here
            seconds = []
            for _ in range(repeats):
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                decode()
                seconds.append(time.perf_counter() - start)
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            out.update(seconds=min(seconds), faults=faults, grew=common.peak_rss_bytes() - base)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    return out


def run(args: argparse.Namespace) -> None:
    scale = "quick" if args.quick else args.scale
    if args.child:
        if args.variant == "reuse":
            from app.runtime import heap

            heap.reuse()
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        return print(json.dumps(measure(args.child, scale, args.mode, args.repeats)))
    from bench import common, table

    print(table.machine_line())
    print(
        "| family | shape | served | glibc s | reuse s | speed-up | glibc faults | reuse faults "
        "| glibc grew MiB | reuse grew MiB |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for family in args.only or table.setups():
        rows = {}
        for variant in VARIANTS:
            command = ["heap", "--child", family, "--variant"]
            command += [variant, "--scale", scale, "--mode", args.mode]
            command += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
            rows[variant] = common.bench_child(command)
            if "error" in rows[variant]:
                print(f"| {family} | {variant} failed: {rows[variant]['error']} |||||||||")
                break
        else:
            print(format_row(family, rows["glibc"], rows["reuse"]), flush=True)


def format_row(family: str, glibc: dict, reuse: dict) -> str:
    return (
        f"| {family} | {glibc['shape']} | {glibc['served']} | {glibc['seconds']:.2f} "
        f"| {reuse['seconds']:.2f} | {glibc['seconds'] / reuse['seconds']:.2f}x "
        f"| {glibc['faults']} | {reuse['faults']} | {glibc['grew'] >> 20} | {reuse['grew'] >> 20} |"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bench import table

    parser.add_argument("--quick", action="store_true", help="small shapes (= --scale quick)")
    parser.add_argument("--scale", choices=table.SCALES, default="full", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", help="rows (bench all's names)")
    parser.add_argument("--mode", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="timed decodes, the best kept")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
