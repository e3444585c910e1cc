"""Decode a latent file in this process from the local model store (``python -m app decode``
without ``--url``), on the exact float32 CPU path the service falls back to.

``decode_file`` is the one entry point. Until the runtime's runner lands it repeats the
service's steps after parsing (de-normalize -> decode -> to [0, 1] -> encode) with the
service's own parsing, layout checks, ``Scaling``, ``to_unit`` and encoders; point it at the
runner then. Module level imports no torch, so the command line fails fast on bad arguments.
"""

from __future__ import annotations

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
    import torch

    decoder = _load_decoder(models_dir, model, timer)
    with timer.phase("parse"):
        z, wire_dtype = _read_latent(latent_path, params, decoder)
    with torch.inference_mode():
        chunks = _iter_decoded(decoder, z, params, timer, on_frames)
        if output == "mp4":
            _write_mp4(decoder, z, chunks, out, params, timer)
        else:
            decoded = _cat(list(chunks))
            with timer.phase("encode"):
                _write_output(decoder, decoded, out, output, params, wire_dtype)


def _load_decoder(store: Path, name: str, timer: Any) -> Any:
    import torch

    from app.store import load_model

    with timer.phase("load"):
        _, decoder = load_model(store, name)
        if any(p.dtype != torch.float32 for p in decoder.parameters()):
            decoder = decoder.float()  # the exact path: float32, as the service's reference
    return decoder


def _read_latent(path: Path, params: dict[str, Any], decoder: Any) -> tuple[Any, Any]:
    """The file -> a float32 [B,C,H,W] / [B,C,T,H,W] latent, checked as the service checks."""
    from app.protocol import DecodeParams, ModelGeometry, parse_body, to_layout

    wire = DecodeParams(height=params.get("height"), width=params.get("width"))
    tensor = parse_body(LATENT_CONTENT_TYPES[path.suffix.lower()], path.read_bytes(), wire)
    geo = ModelGeometry(
        decoder.latent_channels,
        decoder.spatial_scale,
        decoder.temporal_scale,
        decoder.is_video,
        decoder.frames_out,
    )
    return to_layout(tensor, wire, geo).float(), tensor.dtype


def _iter_decoded(
    decoder: Any, z: Any, params: dict[str, Any], timer: Any, on_frames: FrameProgress | None
) -> Iterator[Any]:
    """De-normalize and decode; a video decoder with ``iter_decode`` yields (and reports)
    each frame chunk as it is decoded, anything else one tensor."""
    from app.engine import Scaling

    scaling = Scaling(
        params.get("scaling_factor"), params.get("shift_factor"), bool(params.get("do_scaling"))
    )
    options = {k: params[k] for k in ("timestep", "seed") if k in params}
    with timer.phase("denormalize"):
        z = scaling.apply(decoder, z)
    if not (decoder.is_video and hasattr(decoder, "iter_decode")):
        yield decoder.decode(z, timer, **options)
        return
    total = decoder.frames_out(z.shape[2]) if z.ndim == 5 else 1
    done = 0
    for chunk in decoder.iter_decode(z, timer, **options):
        done += chunk.shape[2]
        if on_frames:
            on_frames(done, total)
        yield chunk


def _cat(chunks: list[Any]) -> Any:
    import torch

    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)


def _write_output(
    decoder: Any, decoded: Any, out: Path, output: str, params: dict[str, Any], wire_dtype: Any
) -> None:
    """An image (one, as the service's image responses) or the raw decode as ``.npy``."""
    import numpy as np
    import torch

    from app import media

    if output == "tensor":
        dtype = wire_dtype if wire_dtype != torch.bfloat16 else torch.float32
        with _atomic(out) as f:
            np.save(f, decoded.to(dtype).numpy())
        return
    unit = decoder.to_unit(decoded)
    frames = unit.permute(0, 2, 1, 3, 4).flatten(0, 1) if unit.ndim == 5 else unit
    if frames.shape[0] != 1:
        raise LocalDecodeError(
            f"this latent decodes to {frames.shape[0]} images; {out.suffix} holds one "
            "(use a batch-1 latent, or .mp4 / .npy)"
        )
    data = media.encode_image(frames[0], IMAGE_FORMATS[output], int(params.get("quality", 90)))
    with _atomic(out) as f:
        f.write(data)


def _write_mp4(
    decoder: Any, z: Any, chunks: Iterator[Any], out: Path, params: dict[str, Any], timer: Any
) -> None:
    """Frames streamed into the encoder chunk by chunk as they are decoded, as the service
    streams them; ``encode`` is the encoder's own time, not the decode it waits on."""
    from app.video import encode_mp4, iter_frames

    if not decoder.is_video:
        raise LocalDecodeError("mp4 output needs a video model (this one decodes images)")
    if z.shape[0] != 1:
        raise LocalDecodeError(f"an mp4 holds one video; this latent is a batch of {z.shape[0]}")
    fps = params.get("fps") or decoder.config.get("fps") or 24
    waited = 0.0

    def frames() -> Iterator[Any]:
        nonlocal waited
        it = iter_frames(decoder.to_unit(chunk) for chunk in chunks)
        while True:
            t0 = time.perf_counter()
            frame = next(it, None)
            waited += time.perf_counter() - t0
            if frame is None:
                return
            yield frame

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
