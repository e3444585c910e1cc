"""Decode a latent file in this process from the local model store (``python -m app decode``
without ``--url``), by default on the exact float32 CPU path the service falls back to.

``decode_file`` is the one entry point: the service's own parsing and layout checks, then
its runtime's runner (the same de-normalize -> decode -> uint8 steps as an HTTP decode) and
its encoders. Module level imports no torch, so the command line fails fast on bad arguments.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

LATENT_CONTENT_TYPES = {".npy": "application/x-npy", ".safetensors": "application/x-safetensors"}
OUTPUT_SUFFIXES = {
    ".png": "png",
    ".jpg": "jpeg",
    ".jpeg": "jpeg",
    ".webp": "webp",
    ".mp4": "mp4",
    ".npy": "tensor",  # the decoder's own output, in the latent's dtype
}
IMAGE_FORMATS = {"png": "png", "jpeg": "jpg", "webp": "webp"}  # output -> app.media's name

FrameProgress = Callable[[int, int], None]  # (frames decoded so far, frames in all)


class LocalDecodeError(Exception):
    """A decode refused in one line: the service's own 4xx words, a model not in the store."""


def output_for(out: Path) -> str:
    """The output an output file's suffix asks for (``png``, ``jpeg``, ..., ``tensor``)."""
    try:
        return OUTPUT_SUFFIXES[out.suffix.lower()]
    except KeyError:
        raise LocalDecodeError(
            f"{out}: cannot tell the output format from the suffix "
            f"(use {', '.join(OUTPUT_SUFFIXES)})"
        ) from None


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
    from app.timing import PhaseTimer

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
    output: str,
    params: dict[str, Any],
    on_frames: FrameProgress | None,
    timer: Any,
) -> None:
    import numpy as np
    import torch

    from app import media
    from app.runtime import Want

    runtime, served = _load(models_dir, model, timer)
    with timer.phase("parse"):
        z, wire_dtype = _read_latent(latent_path, params, served)
    scaling, options = _scaling(params), {k: params[k] for k in ("timestep", "seed") if k in params}
    if output == "mp4":
        _check_video(served, z)
        frames = runtime.runner.stream(served, z, scaling, options, timer)
        fps = params.get("fps") or served.reference.config.get("fps") or 24
        total = served.reference.frames_out(z.shape[2])
        return _write_mp4(_counted(frames, total, on_frames), out, fps, timer)
    want = Want.RAW if output == "tensor" else Want.UINT8
    out_dtype = torch.uint8 if want is Want.UINT8 else wire_dtype
    if out_dtype == torch.bfloat16:
        out_dtype = torch.float32  # .npy has no bfloat16
    if served.reference.is_video and z.shape[0] == 1:  # chunk by chunk, with progress
        chunks = runtime.runner.stream(served, z, scaling, options, timer, want, out_dtype)
        total = served.reference.frames_out(z.shape[2])
        decoded = torch.cat(
            list(_counted(chunks, total, on_frames, axis=2 if want is Want.RAW else 0)),
            dim=2 if want is Want.RAW else 0,
        )
    else:
        decoded = runtime.runner.decode(served, z, scaling, options, want, timer, out_dtype)
    with timer.phase("encode"):
        if output == "tensor":
            with _atomic(out) as f:
                np.save(f, decoded.numpy())
            return
        if decoded.shape[0] != 1:
            raise LocalDecodeError(
                f"this latent decodes to {decoded.shape[0]} images; {out.suffix} holds one "
                "(use a batch-1 latent, or .mp4 / .npy)"
            )
        quality = int(params.get("quality", 90))
        data = media.encode_image(decoded[0], IMAGE_FORMATS[output], quality)
        with _atomic(out) as f:
            f.write(data)


def _load(store: Path, name: str, timer: Any) -> tuple[Any, Any]:
    """The service's runtime for this one model: the exact float32 CPU path unless the
    environment (``VAE_DEVICE``, ``VAE_DTYPE``) asks for another, gated as the service gates."""
    from app.config import Settings
    from app.metrics import Metrics
    from app.runtime import Runtime

    exact = {} if os.environ.get("VAE_DTYPE") else {"dtype": "float32"}
    settings = Settings(models_dir=store, models=name, **exact)
    quiet = logging.getLogger("app.runtime")  # the service's startup lines are noise here
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        with timer.phase("load"):
            runtime = Runtime(settings, Metrics())
            runtime.load_all()
    finally:
        quiet.setLevel(level)
    if name not in runtime.models:
        raise LocalDecodeError(runtime.errors.get(name) or f"model {name!r} did not load")
    return runtime, runtime.models[name]


def _scaling(params: dict[str, Any]) -> Any:
    from app.runtime import Scaling

    return Scaling(
        params.get("scaling_factor"), params.get("shift_factor"), bool(params.get("do_scaling"))
    )


def _read_latent(path: Path, params: dict[str, Any], served: Any) -> tuple[Any, Any]:
    """The file -> a float32 [B,C,H,W] / [B,C,T,H,W] latent, checked as the service checks."""
    from app.protocol import DecodeParams, parse_body, to_layout

    wire = DecodeParams(height=params.get("height"), width=params.get("width"))
    tensor = parse_body(LATENT_CONTENT_TYPES[path.suffix.lower()], path.read_bytes(), wire)
    return to_layout(tensor, wire, served.geometry).float(), tensor.dtype


def _check_video(served: Any, z: Any) -> None:
    if not served.reference.is_video:
        raise LocalDecodeError("mp4 output needs a video model (this one decodes images)")
    if z.shape[0] != 1:
        raise LocalDecodeError(f"an mp4 holds one video; this latent is a batch of {z.shape[0]}")


def _counted(
    chunks: Iterator[Any], total: int, on_frames: FrameProgress | None, axis: int = 0
) -> Iterator[Any]:
    done = 0
    for chunk in chunks:
        done += chunk.shape[axis]
        if on_frames:
            on_frames(done, total)
        yield chunk


def _write_mp4(chunks: Iterator[Any], out: Path, fps: float, timer: Any) -> None:
    """uint8 frame chunks streamed into the encoder as they are decoded, as the service
    streams them; ``encode`` is the encoder's own time, not the decode it waits on."""
    from app.video import encode_mp4

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
    with _atomic(out) as f:
        for data in encode_mp4(frames(), fps):
            f.write(data)
    timer.add("encode", time.perf_counter() - t0 - waited)


@contextmanager
def _atomic(path: Path) -> Iterator[IO[bytes]]:
    """Write beside ``path`` and rename on success: a failed decode leaves no output file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with tmp.open("wb") as f:
            yield f
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
