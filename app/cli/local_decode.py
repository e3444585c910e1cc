"""Decode a latent file in this process from the local model store (``python -m app decode``
without ``--url``), by default on the exact float32 CPU path the service falls back to.

``decode_file`` is the one entry point: the service's own protocol (the file is the body, the
params are the query: the same ``DecodeRequest`` an HTTP decode builds), then its runtime's
runner and its encoders. Module level imports no torch, so the command line fails fast on bad
arguments.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from app.cli.errors import CommandError

LATENT_CONTENT_TYPES = {".npy": "application/x-npy", ".safetensors": "application/x-safetensors"}
# output file suffix -> the query params that ask the service for it
OUTPUT_PARAMS: dict[str, dict[str, str]] = {
    ".png": {"output_type": "pil", "image_format": "png"},
    ".jpg": {"output_type": "pil", "image_format": "jpg"},
    ".jpeg": {"output_type": "pil", "image_format": "jpg"},
    ".webp": {"output_type": "pil", "image_format": "webp"},
    ".mp4": {"output_type": "mp4"},
    ".npy": {"output_type": "pt"},  # the decoder's own output, in the latent's dtype
}

FrameProgress = Callable[[int, int], None]  # (frames decoded so far, frames in all)


class LocalDecodeError(CommandError):
    """A decode refused in one line: the service's own 4xx words, a model not in the store."""


def output_for(out: Path) -> dict[str, str]:
    """The query params an output file's suffix asks for (``output_type``, ``image_format``);
    the file must be one this process can write (checked now, not after a long decode)."""
    try:
        params = OUTPUT_PARAMS[out.suffix.lower()]
    except KeyError:
        raise LocalDecodeError(
            f"{out}: cannot tell the output format from the suffix (use {', '.join(OUTPUT_PARAMS)})"
        ) from None
    check_writable(out)
    return params


def check_writable(out: Path) -> None:
    """``out`` can be written where it is: a file (or none yet) in a writable folder."""
    folder = out.parent
    if out.is_dir():
        raise LocalDecodeError(f"{out} is a folder: -o names the output file")
    if not folder.is_dir():
        raise LocalDecodeError(f"{out}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):  # the file is written beside it, then renamed
        raise LocalDecodeError(f"{out}: the folder {folder} is not writable by this user")


def check_latent_file(path: Path) -> None:
    if not path.is_file():
        raise LocalDecodeError(f"latent file not found: {path}")
    if path.suffix.lower() not in LATENT_CONTENT_TYPES:
        raise LocalDecodeError(f"{path}: a latent file is .npy or .safetensors")


def check_model(models_dir: Path, model: str) -> None:
    """Names the store's entries without importing torch (the manifests are plain files)."""
    if (models_dir / model / "manifest.json").is_file():
        return
    have = sorted(p.parent.name for p in models_dir.glob("*/manifest.json"))
    raise LocalDecodeError(
        f"model {model!r} is not in the store {models_dir} (it has: {', '.join(have) or 'nothing'}); "
        "see --models-dir, `python -m app bake` and `import`"
    )


def decode_file(
    latent_path: Path,
    model: str,
    out: Path,
    models_dir: Path,
    params: dict[str, Any] | None = None,
    on_frames: FrameProgress | None = None,
) -> dict[str, float]:
    """Decode ``latent_path`` with ``model`` from ``models_dir`` into ``out`` (format from its
    suffix); ``params`` are the service's query params (``do_scaling``, ``scaling_factor``,
    ``shift_factor``, ``height``, ``width``, ``fps``, ``quality``, ``timestep``, ``seed``).
    Returns the per-phase times in milliseconds; raises LocalDecodeError for what the service
    would refuse."""
    check_latent_file(latent_path)
    output = output_for(out)
    check_model(models_dir, model)
    t0 = time.perf_counter()
    from app.protocol import ProtocolError
    from app.store import StoreError
    from app.telemetry.timing import PhaseTimer

    timer = PhaseTimer()
    timer.add("import", time.perf_counter() - t0)  # torch's import is most of a small decode
    try:
        _decode(latent_path, model, out, models_dir, output, params or {}, on_frames, timer)
    except ProtocolError as exc:
        hint = f" (expected: {exc.expected})" if exc.expected else ""
        raise LocalDecodeError(f"{exc}{hint}") from exc
    except StoreError as exc:
        raise LocalDecodeError(str(exc)) from exc
    return {name: seconds * 1000 for name, seconds in timer.phases().items()}


def _decode(
    latent_path: Path,
    model: str,
    out: Path,
    models_dir: Path,
    output: dict[str, str],
    params: dict[str, Any],
    on_frames: FrameProgress | None,
    timer: Any,
) -> None:
    import numpy as np
    import torch

    from app.media import write
    from app.protocol.request import Output

    runtime, served = load_runtime(models_dir, model, timer)
    with timer.phase("parse"):
        request = _request(latent_path, {**params, **output}, runtime, served)
    frames = served.reference.frames_out
    if request.output is Output.MP4:
        chunks = runtime.runner.stream(served, request, timer)
        total = frames(request.latent.shape[2])
        threads = runtime.settings.encoder_threads  # bounded, as the service's streams
        return _write_mp4(_counted(chunks, total, on_frames), out, request.fps, threads, timer)
    if request.out_dtype == torch.bfloat16:
        request = replace(request, out_dtype=torch.float32)  # .npy has no bfloat16
    if served.reference.is_video and request.rows == 1:  # chunk by chunk, with progress
        axis = 0 if request.output.frames else 2
        chunks = runtime.runner.stream(served, request, timer)
        total = frames(request.latent.shape[2])
        decoded = torch.cat(list(_counted(chunks, total, on_frames, axis)), dim=axis)
    else:
        decoded = runtime.runner.decode(served, request, timer)
    with timer.phase("encode"):
        with atomic(out) as f:
            if request.output is Output.IMAGE:
                f.write(write.encode_image(decoded[0], request.image_format, request.quality))
            else:
                np.save(f, decoded.numpy())


def _request(path: Path, query: dict[str, Any], runtime: Any, served: Any) -> Any:
    """The file as the body and ``query`` as the params: the service's own ``DecodeRequest``
    (its parsing, layout and limits), or its 4xx words."""
    import asyncio

    from app.protocol import parse_head, validate

    head = parse_head(
        [(k, str(v)) for k, v in query.items()],
        [("content-type", LATENT_CONTENT_TYPES[path.suffix.lower()])],
    )
    limits = runtime.limits(served)
    return asyncio.run(validate(head, served.geometry, limits, lambda limit: path.read_bytes()))


def load_runtime(store: Path, name: str, timer: Any, part: str = "decoder") -> tuple[Any, Any]:
    """The service's runtime for this one model's ``part``: the exact float32 CPU path unless
    the environment (``VAE_DEVICE``, ``VAE_DTYPE``) asks for another, gated as the service
    gates (one candidate, the exact path, is served unmeasured)."""
    from app.config import Settings, given
    from app.runtime import Runtime
    from app.telemetry.metrics import Metrics

    exact = {} if given("dtype") else {"dtype": "float32"}
    settings = Settings(models_dir=store, models=name, serve_encoders=part == "encoder", **exact)
    quiet = logging.getLogger("app.runtime")  # the service's startup lines are noise here
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        with timer.phase("load"):
            runtime = Runtime(settings, Metrics())
            runtime.load_all()
    finally:
        quiet.setLevel(level)
    served = runtime.encoders if part == "encoder" else runtime.models
    if name not in served:
        why = runtime.encoder_errors.get(name) if part == "encoder" else None
        raise LocalDecodeError(why or runtime.errors.get(name) or f"model {name!r} did not load")
    return runtime, served[name]


def _counted(
    chunks: Iterator[Any], total: int, on_frames: FrameProgress | None, axis: int = 0
) -> Iterator[Any]:
    done = 0
    if on_frames:
        on_frames(0, total)  # the total is known before the first frame: the bar shows it
    for chunk in chunks:
        done += chunk.shape[axis]
        if on_frames:
            on_frames(done, total)
        yield chunk


def _write_mp4(chunks: Iterator[Any], out: Path, fps: float, threads: int, timer: Any) -> None:
    """uint8 frame chunks streamed into the encoder as they are decoded, as the service
    streams them; ``encode`` is the encoder's own time, not the decode it waits on."""
    from app.media.mp4 import encode_mp4

    waited = 0.0

    def frames() -> Iterator[Any]:
        nonlocal waited
        while True:
            t0 = time.perf_counter()
            chunk = next(chunks, None)
            waited += time.perf_counter() - t0
            if chunk is None:
                return
            yield from chunk.numpy()

    t0 = time.perf_counter()
    with atomic(out) as f:
        for data in encode_mp4(frames(), fps, threads=threads):
            f.write(data)
    timer.add("encode", time.perf_counter() - t0 - waited)


@contextmanager
def atomic(path: Path) -> Iterator[IO[bytes]]:
    """Write beside ``path`` and rename on success: a failed decode leaves no output file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with tmp.open("wb") as f:
            yield f
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
