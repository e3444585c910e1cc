"""``bake`` and ``import``: the commands that write the model store, from the families'
descriptors (their embedded recipes and their checkpoint converters)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def bake(args: argparse.Namespace) -> int:
    """Write each embedded model (``--only``: those named, baked by default or not)."""
    import torch

    from app.cli.errors import CommandError
    from app.families import families
    from app.runtime.references import store_references
    from app.store import write_model

    store = Path(args.models_dir)
    known = {name for family in families().values() for name in family.synthetic}
    if unknown := sorted(set(args.only or ()) - known):
        raise CommandError(
            f"no embedded model named {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    for key, family in families().items():
        recipes = family.synthetic if args.only else family.baked()
        for name, recipe in recipes.items():
            if (args.only and name not in args.only) or (_complete(store, name) and not args.force):
                continue
            decoder = family.decoder.module(recipe.config)
            family.decoder.init_synthetic(decoder, torch.Generator().manual_seed(0))
            encoder_state = None
            if recipe.encoder_config is not None and family.encoder is not None:
                encoder = family.encoder.module(recipe.encoder_config)
                family.encoder.init_synthetic(encoder, torch.Generator().manual_seed(1))
                encoder_state = encoder.state_dict()
            write_model(
                store,
                name,
                key,
                recipe.config,
                decoder.state_dict(),
                source="synthetic:seed=0",
                dtype="float32",
                encoder_state=encoder_state,
                encoder_config=recipe.encoder_config if encoder_state is not None else None,
            )
            parts = "decoder+encoder" if encoder_state is not None else "decoder"
            refs = "" if args.no_references else f", {store_references(store, name)}"
            print(f"baked {name} ({key}, {parts}) into {args.models_dir}/{name}{refs}")
    return 0


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


def import_checkpoint(args: argparse.Namespace) -> int:
    """Convert a checkpoint once into the store: its decoder, and its encoder where the family
    has one and the checkpoint holds it."""
    from app.cli.errors import CommandError, describe
    from app.families import family
    from app.runtime.references import store_references
    from app.store import PairError, StoreError, check_name, write_model

    if not args.source.exists():
        raise CommandError(f"{args.source}: no such file or folder")
    try:
        check_name(args.name)  # before the conversion, which can take minutes
    except StoreError as exc:
        raise CommandError(f"import refused: {exc}") from None
    described = family(args.family)
    try:
        config, state = described.decoder.convert(args.source)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - any file this family's converter cannot read
        # torch's words for a pickle advise weights_only=False (never); matched by name, as
        # nothing on the load path imports pickle (tests/test_body_limits.py)
        unpickling = type(exc).__name__ == "UnpicklingError"
        why = "a pickle that runs code (refused)" if unpickling else None
        raise CommandError(
            f"{args.source} is not a {args.family} checkpoint that import reads: "
            f'{why or describe(exc)} (README, "Command line", lists what each family imports)'
        ) from exc
    _refuse_not_finite(args.source, state)  # before the encoder's conversion and its notes
    encoder_config, encoder_state = _convert_encoder(described.encoder, args.source)
    _refuse_not_finite(args.source, encoder_state or {})

    def write(encoder_state: dict | None, encoder_config: dict | None) -> Any:
        return write_model(
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

    try:
        try:
            manifest = write(encoder_state, encoder_config)
        except PairError as exc:  # the decoder is still what was asked for
            print(f"no encoder imported: {exc}", file=sys.stderr)
            manifest = write(None, None)
    except StoreError as exc:
        print(f"import refused: {exc}", file=sys.stderr)
        return 2
    refs = "gate references left to the first start"
    if not args.no_references:
        refs = store_references(Path(args.models_dir), manifest.name)  # the gate's outputs
    print(
        f"imported {args.source} as {manifest.name} ({manifest.family}, {manifest.dtype}, "
        f"parts {'+'.join(manifest.parts)}, sha256 {manifest.sha256[:12]}; {refs})"
    )
    return 0


def _refuse_not_finite(source: Path, state: dict[str, Any]) -> None:
    """Weights holding a NaN or an infinity: imported, they would make every decode (or
    encode) a 422 that blames the caller's input."""
    import torch

    from app.cli.errors import CommandError

    bad = [
        name
        for name, tensor in state.items()
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    if bad:
        raise CommandError(f"{source}: weights hold NaN or infinity ({', '.join(bad[:3])})")


def _convert_encoder(part: Any, source: Path) -> tuple[dict | None, dict | None]:
    """The checkpoint's encoder, where the family has one and ``convert`` finds it (it returns
    ``(config, state)``, or None or ``ValueError`` for none); else (None, None)."""
    if part is None:
        return None, None
    try:
        found = part.convert(source)
    except (ValueError, FileNotFoundError) as exc:  # no encoder in the checkpoint
        print(f"no encoder imported: {exc}", file=sys.stderr)
        return None, None
    return found if found is not None else (None, None)
