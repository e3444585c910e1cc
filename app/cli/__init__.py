"""Command line: serve, bake, import, decode, encode (see ``python -m app --help``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_STORE = os.environ.get("VAE_MODELS_DIR", "models")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default=os.environ.get("HOST", "0.0.0.0"))
    serve.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8080")))
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
    from app.decoders import FAMILIES  # names only: no torch

    imp.add_argument("family", help=" | ".join(FAMILIES))
    imp.add_argument("source", type=Path, help="diffusers folder or single checkpoint file")
    imp.add_argument("--name", required=True)
    imp.add_argument("--models-dir", default=DEFAULT_STORE)
    imp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
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

    configure_logging()
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
    import uvicorn

    from app.config import Settings
    from app.http import create_app
    from app.http.timeouts import header_timeout_protocol
    from app.runtime.device import log_runtime
    from app.telemetry.logs import uvicorn_kwargs

    settings = Settings(models_dir=Path(args.models_dir))
    log_runtime(settings.device)
    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=settings.drain_grace_s,
        http=header_timeout_protocol(settings.header_timeout_s),  # slow-header clients: 408
        server_header=False,  # no version banner for scanners
        proxy_headers=True,  # the client address from X-Forwarded-For, from trusted peers only
        forwarded_allow_ips=settings.forwarded_allow_ips,
        **uvicorn_kwargs(),
    )
    return 0


def _bake(args: argparse.Namespace) -> int:
    import torch

    from app.decoders import FAMILIES, family_module
    from app.runtime.references import store_reference
    from app.store import write_model

    store = Path(args.models_dir)
    for family in FAMILIES:
        module = family_module(family)
        for name, config in getattr(module, "SYNTHETIC", {}).items():
            if (args.only and name not in args.only) or (_complete(store, name) and not args.force):
                continue
            decoder = module.Decoder(config)
            module.init_synthetic(decoder, torch.Generator().manual_seed(0))
            encoder_config, encoder_state = _synthetic_encoder(family, name)
            write_model(
                store,
                name,
                family,
                config,
                decoder.state_dict(),
                source="synthetic:seed=0",
                dtype="float32",
                encoder_state=encoder_state,
                encoder_config=encoder_config,
            )
            parts = "decoder+encoder" if encoder_state is not None else "decoder"
            ref = "" if args.no_references else f", gate reference {store_reference(store, name)}"
            print(f"baked {name} ({family}, {parts}) into {args.models_dir}/{name}{ref}")
    return 0


def _synthetic_encoder(family: str, name: str) -> tuple[dict | None, dict | None]:
    """The seeded encoder of a synthetic entry, when its family's encoder package has one of
    that name (``SYNTHETIC``); else (None, None): the entry is decoder-only."""
    import torch

    from app.encoders import encoder_module

    try:
        module = encoder_module(family)
    except KeyError:
        return None, None
    config = getattr(module, "SYNTHETIC", {}).get(name)
    if config is None:
        return None, None
    encoder = module.Encoder(config)
    module.init_synthetic(encoder, torch.Generator().manual_seed(1))
    return dict(config), encoder.state_dict()


def _complete(store: Path, name: str) -> bool:
    """An entry bake may skip: every part present and matching the manifest's hashes."""
    from app.store import StoreError, verify_entry

    if not (store / name).exists():
        return False
    try:
        verify_entry(store, name)
        return True
    except StoreError as exc:
        print(f"rebaking {name}: {exc}", file=sys.stderr)
        return False


def _import(args: argparse.Namespace) -> int:
    from app.decoders import family_module
    from app.runtime.references import store_reference
    from app.store import StoreError, write_model

    config, state = family_module(args.family).convert(args.source)
    encoder_config, encoder_state = _convert_encoder(args.family, args.source)
    try:
        manifest = write_model(
            Path(args.models_dir),
            args.name,
            args.family,
            config,
            state,
            source=str(args.source.resolve()),
            dtype=args.dtype,
            encoder_state=encoder_state,
            encoder_config=encoder_config,
        )
    except StoreError as exc:
        print(f"import refused: {exc}", file=sys.stderr)
        return 2
    store_reference(Path(args.models_dir), manifest.name)  # the gate's reference outputs
    print(
        f"imported {args.source} as {manifest.name} ({manifest.family}, {manifest.dtype}, "
        f"parts {'+'.join(manifest.parts)}, sha256 {manifest.sha256[:12]})"
    )
    return 0


def _convert_encoder(family: str, source: Path) -> tuple[dict | None, dict | None]:
    """The checkpoint's encoder, when the family has an encoder package whose ``convert``
    finds one (it returns ``(config, state)`` or None); else (None, None): decoder only."""
    from app.encoders import encoder_module

    try:
        convert = getattr(encoder_module(family), "convert", None)
    except KeyError:
        return None, None
    if not callable(convert):
        return None, None
    try:
        found = convert(source)
    except (ValueError, FileNotFoundError) as exc:  # no encoder in the checkpoint
        print(f"no encoder imported: {exc}", file=sys.stderr)
        return None, None
    return found if found is not None else (None, None)


def _decode(args: argparse.Namespace) -> int:
    from app.cli.decode import run

    return run(args)


def _encode(args: argparse.Namespace) -> int:
    from app.cli.encode import run

    return run(args)
