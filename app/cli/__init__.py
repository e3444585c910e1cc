"""Command line: serve, bake, import, decode, encode (see ``python -m app --help``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError

from app.cli.errors import one_line  # noqa: E402 (no torch)
from app.config import setting  # noqa: E402 (pydantic only, no torch)

DEFAULT_STORE = str(setting("models_dir"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default=os.environ.get("HOST", "0.0.0.0"))
    serve.add_argument("--port", type=int, help="default: $PORT, else 8080")
    serve.add_argument("--models-dir", default=DEFAULT_STORE)
    serve.set_defaults(run=_serve)

    bake = sub.add_parser("bake", help="write the embedded default models into the store")
    bake.add_argument(
        "--synthetic",
        action="store_true",
        required=True,
        help="deterministic seeded weights (nothing to download)",
    )
    bake.add_argument("--models-dir", default=DEFAULT_STORE)
    bake.add_argument("--only", nargs="*", help="names to bake (default: every embedded one)")
    bake.add_argument("--force", action="store_true", help="rewrite entries already in the store")
    bake.add_argument("--no-references", action="store_true", help="leave the gate references "
                      "to the first start (computed after ready on a CPU, then stored)")  # fmt: skip
    bake.set_defaults(run=_bake)

    imp = sub.add_parser("import", help="convert a checkpoint into the store")
    from app.families import keys  # names only: no torch

    imp.add_argument("family", help=" | ".join(keys()))
    imp.add_argument("source", type=Path, help="diffusers folder or single checkpoint file")
    imp.add_argument("--name", required=True)
    imp.add_argument("--models-dir", default=DEFAULT_STORE)
    imp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    imp.add_argument("--no-references", action="store_true", help="leave the gate references "
                     "to the first start that gates a fast mode (then stored)")  # fmt: skip
    imp.set_defaults(run=_import)

    dec = sub.add_parser("decode", help="decode a latent file (local store or --url)")
    dec.add_argument("latent", type=Path, help=".safetensors or .npy latent")
    dec.add_argument("--model", required=True)
    dec.add_argument("-o", "--output", type=Path, default=Path("out.png"))
    dec.add_argument("--url", help="a running service, e.g. http://127.0.0.1:8080")
    dec.add_argument("--models-dir", default=DEFAULT_STORE)
    dec.add_argument("--timings", action="store_true", help="print the per-phase table")
    dec.add_argument("-q", "--quiet", action="store_true", help="no progress or summary line")
    dec.add_argument("--timeout", type=float, default=600.0, help="--url: seconds for the call")
    dec.add_argument(
        "--do-scaling", action="store_true", help="apply the model's own latent de-normalization"
    )
    dec.add_argument("--scaling-factor", type=float, help="decode z / scaling_factor + shift")
    dec.add_argument("--shift-factor", type=float)
    dec.add_argument("--height", type=int, help="pixel height of a packed [B,N,4C] latent")
    dec.add_argument("--width", type=int, help="pixel width of a packed latent")
    dec.add_argument("--fps", type=float, help="mp4 frame rate (default: the model's, else 24)")
    dec.add_argument("--quality", type=int, help="jpg/webp quality 1..100")
    dec.add_argument("--timestep", type=float, help="timestep-conditioned decoders (LTX)")
    dec.add_argument("--seed", type=int, help="noise seed (LTX noise injection)")
    dec.set_defaults(run=_decode)

    _add_encode(sub)
    args = parser.parse_args(argv)
    from app.telemetry.logs import configure_logging

    try:
        configure_logging()  # reads VAE_LOG_FORMAT
    except ValueError as exc:
        print(f"refusing to start: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(args.run(args) or 0)


def _add_encode(sub: argparse._SubParsersAction) -> None:
    enc = sub.add_parser("encode", help="encode an image or MP4 to a latent (local store or --url)")
    enc.add_argument("input", type=Path, help=".png/.jpg/.webp image or .mp4 video")
    enc.add_argument("--model", required=True, help="a store entry that holds an encoder")
    enc.add_argument(
        "-o",
        "--output",
        type=Path,
        default=Path("latent.safetensors"),
        help=".safetensors|.npy|.bin",
    )
    enc.add_argument("--url", help="a running service, e.g. http://127.0.0.1:8080")
    enc.add_argument("--models-dir", default=DEFAULT_STORE)
    enc.add_argument("--timings", action="store_true", help="print the per-phase table")
    enc.add_argument("-q", "--quiet", action="store_true", help="no progress or summary line")
    enc.add_argument("--timeout", type=float, default=600.0, help="--url: seconds for the call")
    enc.add_argument(
        "--do-scaling", action="store_true", help="apply the model's own latent normalisation"
    )
    enc.add_argument("--scaling-factor", type=float, help="write (z - shift_factor) * this")
    enc.add_argument("--shift-factor", type=float)
    enc.add_argument(
        "--sample", action="store_true", help="a sample of the distribution, not its mean"
    )
    enc.add_argument("--seed", type=int, help="the sample's noise seed (with --sample)")
    enc.add_argument("--packed", action="store_true", help="FLUX's packed [B, N, 4C] layout")
    enc.set_defaults(run=_encode)


def _serve(args: argparse.Namespace) -> int:
    import logging

    from pydantic import ValidationError

    from app.config import Settings, unknown_variables

    for line in unknown_variables():
        logging.getLogger("app.cli").warning(line)
    try:
        settings = Settings(models_dir=Path(args.models_dir))
        port = args.port if args.port is not None else _port(os.environ.get("PORT", "8080"))
    except ValidationError as exc:  # one line, no traceback (and no echo of the inputs)
        logging.getLogger("app.cli").critical("refusing to start: %s", _config_errors(exc))
        return 2
    except ValueError as exc:
        logging.getLogger("app.cli").critical("refusing to start: %s", exc)
        return 2

    from app.runtime import heap

    if settings.heap_reuse:
        heap.reuse()  # before any thread of the service starts

    import uvicorn

    from app.http import create_app
    from app.http.timeouts import header_timeout_protocol
    from app.runtime.device import log_runtime
    from app.telemetry.logs import uvicorn_kwargs

    log_runtime(settings.device)
    tokens = len(settings.tokens())
    logging.getLogger("app.cli").info(
        "auth: %s",
        f"bearer tokens ({tokens})"
        if tokens
        else "open (VAE_API_TOKENS unset: no route needs a token)",
    )
    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=port,
        # a bound only: on SIGTERM the drain sets it to what is left of the deadline
        timeout_graceful_shutdown=settings.drain_grace_s,
        # slow-header clients: 408; a request half in at the shutdown: 503
        http=header_timeout_protocol(settings.header_timeout_s, settings.retry_after_s),
        server_header=False,  # no version banner for scanners
        proxy_headers=True,  # the client address from X-Forwarded-For, from trusted peers only
        forwarded_allow_ips=settings.forwarded_allow_ips,
        **uvicorn_kwargs(),
    )
    return 0


def _port(text: str) -> int:
    """``PORT`` (Cloud Run sets it) as a port number."""
    if not text.strip().isdigit() or not 0 < int(text) < 65536:
        raise ValueError("PORT: a port number, 1..65535")
    return int(text)


def _config_errors(exc: ValidationError) -> str:
    """A settings error as one line: each problem, by variable, without the values given
    (they may hold tokens)."""
    problems = []
    for error in exc.errors(include_url=False, include_input=False):
        reason = error.get("ctx", {}).get("error") or error["msg"]
        names = ", ".join(f"VAE_{str(part).upper()}" for part in error["loc"])
        problems.append(f"{names}: {reason}" if names else str(reason))
    return "; ".join(problems)


@one_line
def _bake(args: argparse.Namespace) -> int:
    from app.cli.store import bake

    return bake(args)


@one_line
def _import(args: argparse.Namespace) -> int:
    from app.cli.store import import_checkpoint

    return import_checkpoint(args)


@one_line
def _decode(args: argparse.Namespace) -> int:
    from app.cli.decode import run

    return run(args)


@one_line
def _encode(args: argparse.Namespace) -> int:
    from app.cli.encode import run

    return run(args)
