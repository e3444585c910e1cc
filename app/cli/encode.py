"""``python -m app encode``: one image or MP4 -> one latent file, in this process from the
local store (app/cli/local_encode.py) or through a running service with ``--url`` (``vae_client``:
the file is sent as it is, the latent comes back in the format the output suffix names).
Progress on stderr, ``--timings``' table on stdout, any failure as one ``error:`` line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from app.cli.decode import Progress, format_timings
from app.cli.errors import CommandError
from app.cli.local_encode import OPTION_NAMES, check_input_file, check_latent_output, encode_file


def run(args: argparse.Namespace) -> int:
    source, out, store = Path(args.input), Path(args.output), Path(args.models_dir)
    check_input_file(source)
    check_latent_output(out)
    if args.seed is not None and not args.sample:
        raise CommandError("--seed only applies with --sample (the mean has no noise)")
    options = {n: getattr(args, n) for n in OPTION_NAMES}
    options = {k: v for k, v in options.items() if v is not None and v is not False}
    where = args.url or f"store {store}"
    started = time.monotonic()
    with Progress(f"encoding {source.name} with {args.model} ({where})", not args.quiet):
        if args.url:
            shape, timings = _encode_remote(args, source, out, options)
        else:
            shape, timings = encode_file(source, args.model, out, store, options)
    elapsed = time.monotonic() - started
    if not args.quiet:
        print(
            f"wrote {out} (latent {list(shape) if shape else '?'}, {out.stat().st_size} bytes) "
            f"in {elapsed:.2f} s",
            file=sys.stderr,
        )
    if args.timings:
        print(format_timings(timings, elapsed * 1000))
    return 0


def _encode_remote(
    args: argparse.Namespace, source: Path, out: Path, options: dict[str, Any]
) -> tuple[list[int] | None, dict[str, float]]:
    try:
        from vae_client import Client, DecodeError
    except ImportError:
        raise CommandError(
            "--url needs the client: pip install ./clients/python (vae-render-client)"
        ) from None
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no per-request INFO lines
    try:
        with Client(args.url, timeout=args.timeout, deadline=args.timeout, max_retries=3) as c:
            c.encode_to_file(source, out, args.model, **options)
            shape = c.last_call.headers.get("shape") if c.last_call else None
            return (json.loads(shape) if shape else None), c.last_timings
    except DecodeError as exc:
        raise CommandError(str(exc)) from exc
