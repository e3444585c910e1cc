"""MP4 output: decoded frames streamed into ffmpeg (the binary imageio-ffmpeg ships).

``encode_mp4(frames, fps)`` consumes an iterator of uint8 ``[H, W, 3]`` frames and yields MP4
bytes as ffmpeg produces them, so a response can stream while the decoder is still running
and no second copy of the video is ever held.

Container choice: fragmented MP4 (``-movflags frag_keyframe+empty_moov+default_base_moof``).
A plain MP4 needs its ``moov`` index written after the last frame into a seekable file (or
rewritten to the front with ``+faststart``, a second pass), so nothing could be sent before
the encode ends. A fragmented MP4 writes an empty ``moov`` up front and then self-contained
``moof``/``mdat`` fragments to a pipe: browsers, ffmpeg/ffprobe, PyAV and imageio all play
and probe it. The header leaves with the first frame, then one fragment per keyframe
(every ``KEYFRAME_SECONDS`` of video).

Codec: H.264 (libx264), yuv420p, ``crf`` 18 by default (visually lossless), ``preset``
veryfast, ``threads`` encoder threads (libx264's own default is 1.5x the cores, per ffmpeg:
a host running one ffmpeg per stream next to the decoder would be oversubscribed). yuv420p subsamples chroma 2x2, so a frame with an odd width or height is padded to
even by repeating its last column / row (edge pixels, not black); the MP4 is that even size.
"""

from __future__ import annotations

import atexit
import functools
import os
import selectors
import subprocess
import tempfile
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import IO

import numpy as np
import torch
from torch import Tensor

from app.config import setting

READ_SIZE = 1 << 16
_running: set[subprocess.Popen] = set()  # live encoders, so an exiting process ends them all
_running_lock = threading.Lock()
KEYFRAME_SECONDS = 2  # a keyframe (and so a new MP4 fragment on the wire) every 2 s of video


def ffmpeg_exe() -> str:
    """The ffmpeg binary bundled with imageio-ffmpeg (imported lazily: it is optional here)."""
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


def to_uint8(chunk: Tensor) -> np.ndarray:
    """A decoded chunk ``[B, 3, t, H, W]`` in [0, 1] -> uint8 ``[B, t, H, W, 3]`` (rounded,
    as diffusers' video post-processing does)."""
    x = chunk.detach().clamp(0, 1).mul(255).round().to(torch.uint8)
    return x.permute(0, 2, 3, 4, 1).cpu().numpy()


def iter_frames(chunks: Iterable[Tensor], batch_index: int = 0) -> Iterator[np.ndarray]:
    """uint8 ``[H, W, 3]`` frames of one batch element from ``[B, 3, t, H, W]`` chunks in
    [0, 1], converted one chunk at a time."""
    for chunk in chunks:
        yield from to_uint8(chunk[batch_index : batch_index + 1])[0]


def even_frame(frame: np.ndarray) -> np.ndarray:
    """Pad an odd height / width to even by repeating the last row / column."""
    h, w = frame.shape[:2]
    if h % 2 == 0 and w % 2 == 0:
        return frame
    return np.pad(frame, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge")


def ffmpeg_args(
    width: int, height: int, fps: float, crf: int, preset: str, threads: int | None = None
) -> list[str]:
    """rgb24 frames on stdin -> fragmented H.264/yuv420p MP4 on stdout; ``threads`` bounds
    the encoder's and the pixel-format conversion's threads (None: ffmpeg's default)."""
    bounded = ["-threads", str(threads), "-filter_threads", "1"] if threads else []
    return [
        ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-nostdin",
        "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}", "-r", f"{fps:g}",
        "-i", "pipe:0", "-an",
        *codec_args(h264_encoder(), crf, preset), *bounded,
        "-g", str(max(1, round(KEYFRAME_SECONDS * fps))),
        "-movflags", "frag_keyframe+empty_moov+default_base_moof",
        "-f", "mp4", "pipe:1",
    ]  # fmt: skip


def codec_args(encoder: str, crf: int, preset: str) -> list[str]:
    if encoder == "h264_nvenc":  # the GPU's encoder: constant quality, its own presets
        return ["-c:v", "h264_nvenc", "-pix_fmt", "yuv420p", "-preset", "p4", "-cq", str(crf + 2)]
    return ["-c:v", "libx264", "-pix_fmt", "yuv420p", "-preset", preset, "-crf", str(crf)]


@functools.cache
def h264_encoder() -> str:
    """``h264_nvenc`` where this ffmpeg has it and the GPU can run it (an L4 can, an H200 has
    no NVENC), else ``libx264``. Tried once with a tiny encode: a listed encoder may still
    fail to open on a card without the hardware. ``VAE_H264_ENCODER`` forces one."""
    forced = setting("h264_encoder")
    if forced:
        return forced
    try:
        import torch

        if not torch.cuda.is_available():
            return "libx264"
        cmd = [
            ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-nostdin",
            "-f", "lavfi", "-i", "color=black:s=256x256:d=0.1", "-frames:v", "2",
            "-c:v", "h264_nvenc", "-f", "null", "-",
        ]  # fmt: skip
        ok = subprocess.run(cmd, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return "h264_nvenc" if ok else "libx264"


def encode_mp4(
    frames: Iterable[np.ndarray],
    fps: float = 24,
    *,
    crf: int = 18,
    preset: str = "veryfast",
    threads: int | None = None,
    started: Callable[[subprocess.Popen], None] | None = None,
) -> Iterator[bytes]:
    """Stream uint8 ``[H, W, 3]`` frames into ffmpeg; yield the MP4 bytes as they come.

    Single-threaded: a selector interleaves writing frames to ffmpeg's stdin with reading
    its stdout, so neither pipe can fill up and deadlock. Frames are pulled from ``frames``
    only when ffmpeg can take more (the decoder runs in step with the encoder). Closing the
    generator early kills ffmpeg; ``started`` gets the process as soon as it runs, so another
    thread can kill it (``reap``) while this generator is blocked. Raises ``RuntimeError``
    with ffmpeg's message on failure.
    """
    it = iter(frames)
    first = next(it, None)
    if first is None:
        raise ValueError("encode_mp4: no frames")
    first = even_frame(_check_frame(first, None))
    height, width = first.shape[:2]
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            ffmpeg_args(width, height, fps, crf, preset, threads),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
        )  # fmt: skip
        with _running_lock:
            _running.add(proc)
        if started is not None:
            started(proc)
        try:
            early = yield from _pump(proc, _frame_bytes(first, it, (height, width)))
            _finish(proc, errors, early)
        finally:
            reap(proc)  # closed early, or a frame source failed
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None and not pipe.closed:
                    pipe.close()


def reap(proc: subprocess.Popen, timeout: float = 1.0) -> None:
    """Kill ffmpeg if it still runs and collect its exit (no zombie); safe from any thread."""
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:  # SIGKILL is not refused: only a stuck kernel gets here
        pass
    with _running_lock:
        _running.discard(proc)


@atexit.register
def reap_all() -> None:
    """At exit (a shutdown that left streams unfinished): no encoder outlives the server."""
    with _running_lock:
        procs = list(_running)
    for proc in procs:
        reap(proc)


def _check_frame(frame: np.ndarray, size: tuple[int, int] | None) -> np.ndarray:
    if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
        raise ValueError(f"frames must be uint8 [H, W, 3], got {frame.dtype} {frame.shape}")
    if size is not None and even_frame(frame).shape[:2] != size:
        raise ValueError(f"frame size changed mid-video: {frame.shape[:2]} vs {size}")
    return frame


def _frame_bytes(
    first: np.ndarray, rest: Iterator[np.ndarray], size: tuple[int, int]
) -> Iterator[memoryview]:
    """Each frame as one flat byte view (no copy when it is already contiguous)."""
    yield memoryview(np.ascontiguousarray(first)).cast("B")
    for frame in rest:
        yield memoryview(np.ascontiguousarray(even_frame(_check_frame(frame, size)))).cast("B")


def _pump(proc: subprocess.Popen, frames: Iterator[memoryview]) -> Generator[bytes, None, bool]:
    """Write frames to stdin and read stdout as each becomes ready; yield output bytes.

    Returns True when ffmpeg stopped reading before it got every frame."""
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin.fileno(), proc.stdout.fileno()
    os.set_blocking(stdin, False)
    sel = selectors.DefaultSelector()
    sel.register(stdout, selectors.EVENT_READ)
    sel.register(stdin, selectors.EVENT_WRITE)
    pending: memoryview | None = None
    early = False
    try:
        while True:
            for key, _ in sel.select():
                if key.fd == stdout:
                    data = os.read(stdout, READ_SIZE)
                    if not data:  # EOF: ffmpeg is done
                        return early or not proc.stdin.closed
                    yield data
                    continue
                if pending is None:
                    pending = next(frames, None)
                try:
                    if pending is not None:
                        pending = _write_some(stdin, pending)
                        continue
                except BrokenPipeError:
                    early = True
                sel.unregister(stdin)  # all sent (or refused): EOF lets ffmpeg finish
                proc.stdin.close()
    finally:
        sel.close()


def _write_some(fd: int, buf: memoryview) -> memoryview | None:
    """Write what the pipe takes now; the rest, or None when the frame is all out."""
    try:
        n = os.write(fd, buf)
    except BlockingIOError:
        return buf
    return buf[n:] if n < len(buf) else None


def _finish(proc: subprocess.Popen, errors: IO[bytes], early: bool) -> None:
    if proc.wait() != 0 or early:
        errors.seek(0)
        message = errors.read().decode(errors="replace").strip()[-2000:]
        raise RuntimeError(f"ffmpeg failed (exit {proc.returncode}): {message or 'no message'}")
