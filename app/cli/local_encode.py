"""Encode an image or video file in this process from the local model store (``python -m app
encode`` without ``--url``): the entry's encoder, by default on the exact float32 CPU path.

``encode_file`` is the one entry point: the service's own protocol (the file is the body, its
type by suffix: images preprocessed as diffusers' ``VaeImageProcessor`` does, MP4s read by
``app.media.read`` with the container forced) and its runtime's runner. Module level imports
no torch, so the command line fails fast on bad arguments.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from app.cli.local_decode import (
    LocalDecodeError,
    atomic,
    check_model,
    check_writable,
    load_runtime,
)

BODY_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
              ".webp": "image/webp", ".mp4": "video/mp4"}  # fmt: skip
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".mp4",)
LATENT_SUFFIXES = (".safetensors", ".npy", ".bin")
OPTION_NAMES = ("scaling_factor", "shift_factor", "do_scaling", "sample", "seed", "packed")


class LocalEncodeError(LocalDecodeError):
    """An encode refused in one line: a missing file, a model not in the store, no encoder."""


def check_input_file(path: Path) -> None:
    if not path.is_file():
        raise LocalEncodeError(f"input file not found: {path}")
    if path.suffix.lower() not in IMAGE_SUFFIXES + VIDEO_SUFFIXES:
        raise LocalEncodeError(
            f"{path}: an image or video is {', '.join(IMAGE_SUFFIXES + VIDEO_SUFFIXES)}"
        )


def check_latent_output(path: Path) -> None:
    if path.suffix.lower() not in LATENT_SUFFIXES:
        raise LocalEncodeError(
            f"{path}: the latent file is {', '.join(LATENT_SUFFIXES)} (the suffix names the format)"
        )
    check_writable(path)


def encode_file(
    source: Path, model: str, out: Path, models_dir: Path, options: dict[str, Any] | None = None
) -> tuple[tuple[int, ...], dict[str, float]]:
    """Encode ``source`` with ``model``'s encoder into ``out`` (``.safetensors``: one tensor
    ``latent``; ``.npy``; ``.bin``: the raw little-endian float32 bytes). ``options`` are the
    service's encode params (``OPTION_NAMES``). Returns the latent's shape and the per-phase
    times in milliseconds; raises LocalEncodeError for what the service would refuse."""
    check_input_file(source)
    check_latent_output(out)
    try:
        check_model(models_dir, model)
    except LocalDecodeError as exc:
        raise LocalEncodeError(str(exc)) from None
    check_encoder(models_dir, model)
    t0 = time.perf_counter()
    from app.telemetry.timing import PhaseTimer

    timer = PhaseTimer()
    timer.add("import", time.perf_counter() - t0)
    shape = _encode(source, model, out, models_dir, dict(options or {}), timer)
    return shape, {name: seconds * 1000 for name, seconds in timer.phases().items()}


def check_encoder(models_dir: Path, model: str) -> None:
    """A decoder-only entry is refused from its manifest, before torch is imported or the
    decoder is loaded (the store's own reader checks the manifest again when it loads)."""
    try:
        parts = json.loads((models_dir / model / "manifest.json").read_text()).get("parts")
    except (OSError, ValueError) as exc:
        raise LocalEncodeError(f"{model}: unreadable manifest: {exc}") from None
    if not isinstance(parts, dict) or "encoder" not in parts:
        raise LocalEncodeError(
            f"{model} holds no encoder (a decoder-only entry): it can decode, not encode"
        )


def _encode(
    source: Path, model: str, out: Path, store: Path, options: dict[str, Any], timer: Any
) -> tuple[int, ...]:
    """The service's own path: its protocol reads the file as a body (the same checks and
    pixels), its runtime encodes it (the same runner, a video's clip window by window)."""
    from app.protocol import ProtocolError
    from app.runtime.runner import InvalidInput, NonFiniteOutput

    runtime, served = load_runtime(store, model, timer, part="encoder")
    try:
        with timer.phase("parse"):
            request = _request(source, options, runtime, served)
    except ProtocolError as exc:
        hint = f" (expected: {exc.expected})" if exc.expected else ""
        raise LocalEncodeError(f"{source}: {exc}{hint}") from None
    try:
        latent = _run(runtime, served, request, timer)
    except (InvalidInput, NonFiniteOutput) as exc:
        raise LocalEncodeError(f"{model}: {exc}") from None
    finally:
        if hasattr(request.pixels, "close"):
            request.pixels.close()
    with timer.phase("write"):
        write_latent(latent, out)
    return tuple(latent.shape)


def _request(path: Path, options: dict[str, Any], runtime: Any, served: Any) -> Any:
    """The file as the body (its type by suffix) and ``options`` as the query."""
    import asyncio

    from app.protocol.encode import EncoderGeometry, parse_encode_head, validate_encode

    query = [(k, _wire(v)) for k, v in options.items() if v is not None and v is not False]
    head = parse_encode_head(query, [("content-type", BODY_TYPES[path.suffix.lower()])])
    limits = runtime.limits(served)
    geo = EncoderGeometry.of(served.active)
    return asyncio.run(validate_encode(head, geo, limits, lambda limit: path.read_bytes()))


def _wire(value: Any) -> str:
    return "true" if value is True else str(value)


def _run(runtime: Any, served: Any, request: Any, timer: Any) -> Any:
    """A video is encoded chunk by chunk, as the worker runs it; an image in one run."""
    import torch

    from app.runtime.scheduler import Job

    runner = runtime.runner
    if Job(served, request, timer).chunked:
        chunks = list(runner.chunks(served, request, timer))
        return runner.assemble(served, request, chunks, timer)
    return torch.cat(runner.rows(served, request, timer))


def write_latent(z: Any, out: Path) -> None:
    import numpy as np
    from safetensors.torch import save

    z = z.contiguous().float()
    with atomic(out) as f:
        suffix = out.suffix.lower()
        if suffix == ".safetensors":
            f.write(save({"latent": z}))
        elif suffix == ".npy":
            np.save(f, z.numpy())
        else:
            f.write(z.numpy().astype("<f4").tobytes())
