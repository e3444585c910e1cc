"""python -m bench FAMILY [options]: see each bench module's docstring."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "all": "bench.table",
    "profile": "bench.profile",
    "encode": "bench.encode",
    "flux": "bench.flux",
    "hunyuan-video": "bench.hunyuan_video",
    "ltx": "bench.ltx",
    "ltx2": "bench.ltx2",
    "minimax-h3": "bench.minimax_h3",
    "png": "bench.png",
    "series": "bench.series",
    "startup": "bench.startup",
    "taesd": "bench.taesd",
    "wan": "bench.wan",
    "winograd-bf16": "bench.winograd_bf16",
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    sub = parser.add_subparsers(dest="family", required=True)
    modules = {}
    for name, path in BENCHES.items():
        try:
            modules[name] = importlib.import_module(path)
        except ModuleNotFoundError as exc:  # the peer (diffusers) is a test extra: skip only that
            if exc.name != "diffusers":
                raise
            continue
        modules[name].add_arguments(
            sub.add_parser(name, help=modules[name].__doc__.splitlines()[0])
        )
    args = parser.parse_args()
    modules[args.family].run(args)


main()
