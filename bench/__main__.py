"""python -m bench COMMAND [options]: see each bench module's docstring.

The commands are the tools (``TOOLS``) and every family's bench modules, named as the family
descriptors' ``bench`` rows name them (``app.families``): a family's bench is listed here by
its descriptor alone. (``python -m bench.stream_ends`` is run on its own: it measures with
the test helpers of ``tests/``, which an installed copy does not have.)
"""

from __future__ import annotations

import argparse
import importlib
import sys

TOOLS = {
    "all": "bench.table",
    "encode": "bench.encode",
    "heap": "bench.heap",
    "png": "bench.png",
    "profile": "bench.profile",
    "series": "bench.series",
    "startup": "bench.startup",
    "winograd-bf16": "bench.winograd_bf16",
}


def benches() -> dict[str, str]:
    """Command -> bench module: the tools, then every family's bench rows (descriptors)."""
    from app.families import families  # torch: only when the command list is wanted

    rows = {row: module for f in families().values() for row, module in f.bench.items()}
    if clash := TOOLS.keys() & rows.keys():
        raise ValueError(f"family bench rows named as tools: {sorted(clash)}")
    return {**TOOLS, **rows}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench")
    sub = parser.add_subparsers(dest="command", required=True)
    known = benches()
    # a command imports its own module only (each imports its peer, diffusers: seconds);
    # anything else (--help, a typo) lists them all
    chosen = {argv[0]: known[argv[0]]} if argv and argv[0] in known else known
    modules = {}
    for name, path in chosen.items():
        try:
            modules[name] = importlib.import_module(path)
        except ModuleNotFoundError as exc:  # the peer (diffusers) is a test extra: skip only that
            if exc.name != "diffusers":
                raise
            continue
        modules[name].add_arguments(
            sub.add_parser(name, help=modules[name].__doc__.splitlines()[0])
        )
    args = parser.parse_args(argv)
    modules[args.command].run(args)


if __name__ == "__main__":
    main()
