"""Untrusted images and MP4s -> uint8 RGB pixels: the one reader ``POST /encode`` and
``python -m app encode`` share.

Images: every Pillow mode becomes the 8-bit RGB it means (``rgb_image``); Pillow's own
``convert("RGB")`` clips 16-bit grey to white.

MP4s: ffmpeg (the binary imageio-ffmpeg ships) is run with the container forced to MP4 and
whitelists for formats, protocols and codecs, so a body can never make ffmpeg open another
file (an ffconcat script, an HLS playlist, a DASH manifest, a ``dref`` atom). The stream is
probed without decoding (``probe_mp4``: its size, and its frame count from copying its
packets) so a caller can refuse it before any pixel exists; ``mp4_frames`` then yields the
decoded frames one at a time, holding each to the probed size and stopping at the frame
limit, since a container can lie. Each ffmpeg run is bounded in memory whatever the
container claims (``PROBE_MEMORY``). ffmpeg's messages reach a caller as one fixed sentence
and at most the last line of its stderr with paths removed.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import torch
from PIL import Image, JpegImagePlugin
from torch import Tensor

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # what Pillow may open: no other plugin sees a body
MP4_DEMUXERS = "mov,mp4,m4a,3gp,3g2,mj2"  # ffmpeg's one ISO-BMFF demuxer, all its names
# the video decoders a diffusion clip comes in; libdav1d is ffmpeg's AV1 decoder of choice
VIDEO_DECODERS = "h264,hevc,mpeg4,vp8,vp9,av1,libdav1d,mjpeg"
NOT_AN_MP4 = "not a readable MP4 (H.264/HEVC/VP9/AV1 video in an MP4 container)"
PROBE_TIMEOUT_S = 60.0  # copying packets is fast: only a hostile index takes this long
# the most one frame may take to come out of ffmpeg once asked for: a 2048x2048 frame takes a
# fraction of a second; a stalled decoder (one deadlocked when its memory cap refused it a
# thread) would block the worker that reads it, and every request behind it
FRAME_TIMEOUT_S = 30.0
MAX_PROBE_LOG = 1 << 20  # of ffmpeg's stream listing; its metadata comes first and can be huge
LOG_TAIL = 4096  # of ffmpeg's stderr, where its last line is
DISCARD = 0x4  # AV_PKT_FLAG_DISCARD: an edit list hides the packet's frame
MAX_ALLOC = 64 << 20  # ffmpeg's largest single allocation (-max_alloc), at least
# -max_alloc bounds one allocation, not their sum: a 27 KB MP4 of 40 tracks, each claiming 5.5
# million samples (an index of 132 MB, under it), made a probe take 5.3 GB. So every ffmpeg
# run also has a cap on all its writable memory (``_bounded``), from what this module's
# commands were measured to need: a probe 33 MiB for any clip up to 2048x2048 (4:4:4 10-bit
# included); a decode with DECODE_THREADS and a slow reader (ffmpeg's queues full) 74 MiB at
# 64x64, 737 MiB at 2048x2048 (H.264 4:4:4 10-bit, 16 references: 158 bytes a pixel over the
# base; 4:2:0 8-bit, a third of that).
PROBE_MEMORY = 128 << 20  # a probe's in all, the index included
DECODE_MEMORY = 64 << 20  # a decode's on top of PROBE_MEMORY: its threads' stacks, its queues,
DECODE_BYTES_PER_PIXEL = 256  # and its frames (references, queued, converted to RGB)
# a decode's threads, pinned so that its memory does not grow with the host's cores (ffmpeg's
# default: a thread per core and one more, each with a stack and frames), as app/media/mp4.py
# pins its encoder's
DECODE_THREADS = 2
OUT_OF_MEMORY = (b"Cannot allocate memory", b"pthread_create() failed")  # what ffmpeg says then
# A progressive JPEG's every scan is a pass over every block of the image (5,000 scans of one
# 2048x2048 image: 2 s, 30,000: 150 s); an encoder writes about ten; 500 as libjpeg-turbo's
# fuzzers (metadata, a motion photo's appended video, can hold FF DA too; 500 scans of
# 2048x2048 cost about 0.3 s). The protocol refuses a body declared image/jpeg past it
# (app/protocol/encode.py); Pillow opens a JPEG whatever the declared type, so ``rgb_image``
# holds any JPEG, by what it is, to the same limit.
MAX_JPEG_SCANS = 500
GREY_16_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
VIDEO_STREAM = re.compile(r"^  Stream #0:\d+\S*: Video: .*?[ ,](\d+)x(\d+)[ ,]")
HEAP_TAG = re.compile(r"\[[^\]]*@ 0x[0-9a-fA-F]+\]\s*")  # "[h264 @ 0x55d...]": an address
PATH = re.compile(r"(?:file:)?(?<![\w/.])/[^\s'\"]*")


class MediaError(ValueError):
    """A body the reader refuses; ``status`` is the HTTP status the service answers: 400
    (the message then starts with ``NOT_AN_MP4``), 413 (past a limit, which it names) or 422
    (a JPEG past ``MAX_JPEG_SCANS``, as the protocol answers a declared one)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _unreadable(detail: str) -> MediaError:
    return MediaError(400, f"{NOT_AN_MP4}: {detail}" if detail else NOT_AN_MP4)


def rgb_image(image: Image.Image) -> Image.Image:
    """Any Pillow mode -> 8-bit RGB at the values it means. 16-bit grey (``I;16*``, and
    ``I`` when it holds 16-bit values) is scaled by 255/65535; every other mode goes through
    ``convert("RGB")`` as diffusers' ``VaeImageProcessor`` does (alpha dropped, palettes
    looked up, 1-bit to 0/255). Pillow opens 16-bit RGB(A) PNGs as 8-bit already. A JPEG
    of more than ``MAX_JPEG_SCANS`` scans is refused before it is decoded."""
    if isinstance(image, JpegImagePlugin.JpegImageFile) and image.tile and image.fp:
        if _jpeg_scans(image.fp) > MAX_JPEG_SCANS:
            raise MediaError(422, f"the JPEG has more than {MAX_JPEG_SCANS} scans (the limit)")
    if image.mode in GREY_16_MODES or image.mode == "I":
        return Image.fromarray(_grey_to_8_bit(np.asarray(image)), "L").convert("RGB")
    return image.convert("RGB")


def _jpeg_scans(file: IO[bytes]) -> int:
    """A JPEG's start-of-scan markers (FF DA), counted a MiB at a time up to one past
    ``MAX_JPEG_SCANS``: at least its scans, since entropy-coded data holds an FF only before
    00, a restart or a marker (its metadata may add a few). ``file``'s position is kept."""
    at, count, carry = file.tell(), 0, b""
    file.seek(0)
    while count <= MAX_JPEG_SCANS and (chunk := file.read(1 << 20)):
        data = carry + chunk  # a marker across two chunks counts once
        count += data.count(b"\xff\xda")
        carry = data[-1:]
    file.seek(at)
    return count


def _grey_to_8_bit(values: np.ndarray) -> np.ndarray:
    """16-bit grey -> uint8, rounded (v * 255 / 65535 is v / 257). Mode ``I`` is 32-bit: read
    as 16-bit when it fits (what PNG's 16-bit grey becomes), else as 0..2**31-1."""
    grey = values.astype(np.int64)
    top = 65535 if grey.max(initial=0) <= 65535 else 2**31 - 1
    grey = np.clip(grey, 0, top)
    return ((grey * 255 + top // 2) // top).astype(np.uint8)


@dataclass(frozen=True)
class VideoInfo:
    """An MP4's first video stream as probed, before any frame is decoded."""

    width: int
    height: int
    frames: int  # packets a decoder shows (an edit list's discarded ones not counted)


def to_pixels(frames: list[Image.Image], multiple: int) -> Tensor:
    """RGB frames -> ``[3, T, H, W]`` float32 in [-1, 1], as diffusers' ``VaeImageProcessor``
    makes them: sizes rounded down to ``multiple`` with Lanczos, then ``2 * x / 255 - 1``."""
    w, h = frames[0].size
    size = (w - w % multiple, h - h % multiple)
    if min(size) < multiple:
        raise MediaError(422, f"input {w}x{h} is smaller than one latent cell ({multiple} px)")
    if size != (w, h):  # diffusers' resize to the scale factor's multiple
        frames = [f.resize(size, resample=Image.LANCZOS) for f in frames]
    array = np.stack([np.asarray(f, dtype=np.float32) for f in frames])  # [T,H,W,3]
    return torch.from_numpy(array).permute(3, 0, 1, 2) / 127.5 - 1.0


class Mp4Clip:
    """An MP4 body's frames as an encoder reads them (``app.families.encoder.Clip``): decoded
    from ffmpeg only when a window asks for them, each made into pixels as ``to_pixels``
    makes them, the frames before ``release`` dropped. The whole clip is never in memory:
    what an encode holds is its schedule's window. Owns the body's temporary file until
    ``close``."""

    def __init__(self, body: bytes, *, max_frames: int, max_pixels: int, multiple: int) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="encode-")
        self._cleanup = weakref.finalize(self, self._folder.cleanup)  # also if never closed
        path = Path(self._folder.name) / "body.mp4"
        path.write_bytes(body)
        self.file_bytes = len(body)  # the temporary file's size
        self.info = probe_mp4(path, max_frames=max_frames, max_pixels=max_pixels)
        self._frames = mp4_frames(path, self.info, max_frames=max_frames)
        self._multiple = multiple
        self._held: dict[int, Tensor] = {}
        self._decoded = self._released = 0
        self._size: tuple[int, ...] = ()
        first = self._next_frame()
        if first is None:
            self.close()
            raise _unreadable("it holds no frames")
        _, h, w = self._size = tuple(first.shape)
        self.shape = (1, 3, self.info.frames, h, w)

    def window(self, start: int, stop: int) -> Tensor:
        """Frames ``[start, stop)`` as ``[1, 3, t, H, W]`` (fewer at the end of the clip)."""
        stop = min(stop, self.shape[2])
        if start < self._released:
            raise ValueError(f"frames before {self._released} were released; asked from {start}")
        while self._decoded < stop:
            if self._next_frame() is None:
                raise ValueError(
                    f"the MP4 decodes to {self._decoded} frames, its index counts {self.shape[2]}"
                )
        return torch.stack([self._held[i] for i in range(start, stop)], 1).unsqueeze(0)

    def release(self, before: int) -> None:
        for i in range(self._released, min(before, self._decoded)):
            self._held.pop(i, None)
        self._released = max(self._released, before)

    def close(self) -> None:
        """End ffmpeg and remove the body's temporary file."""
        self._frames.close()
        self._held.clear()
        self._cleanup()

    def _next_frame(self) -> Tensor | None:
        frame = next(self._frames, None)
        if frame is None:
            return None
        pixels = to_pixels([Image.fromarray(frame)], self._multiple)[:, 0]
        if self._size and tuple(pixels.shape) != self._size:
            raise _unreadable("its frames change size")
        self._held[self._decoded] = pixels
        self._decoded += 1
        return pixels


@contextmanager
def mp4_file(body: bytes) -> Iterator[Path]:
    """The body in a private temporary folder (the mov demuxer seeks: a pipe will not do)."""
    with tempfile.TemporaryDirectory(prefix="encode-") as folder:
        path = Path(folder) / "body.mp4"
        path.write_bytes(body)
        yield path


def _ffmpeg_input(
    path: Path, max_pixels: int | None = None, threads: int | None = None
) -> list[str]:
    """ffmpeg reading ``path`` as an MP4 and nothing else: the demuxer is forced, never
    guessed from the content (which is how a concat script, playlist or manifest would get
    in), only ``file:`` may be opened, only video decoders. The mov demuxer's
    ``enable_drefs`` (tracks whose data lives in another file a ``dref`` atom names) is off
    by default and is pinned off here, with ``use_absolute_path``. ``threads``: the
    decoder's (None: ffmpeg's default)."""
    import imageio_ffmpeg

    # no single allocation past this: a 3 KB container that claims 80 million samples made
    # the mov demuxer's index (24 bytes a sample) 4 GB; frames need far less (an RGB frame of
    # max_pixels, at most)
    most = max(MAX_ALLOC, 8 * (max_pixels or 0))
    args = [imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-hide_banner", "-max_alloc", str(most)]
    args += ["-protocol_whitelist", "file", "-format_whitelist", MP4_DEMUXERS]
    args += ["-codec_whitelist", VIDEO_DECODERS, "-f", "mp4"]
    args += ["-enable_drefs", "0", "-use_absolute_path", "0"]
    if max_pixels:  # the decoders' own bound: a stream that lies cannot allocate past it
        args += ["-max_pixels", str(max_pixels)]
    if threads:
        args += ["-threads", str(threads)]
    return [*args, "-i", f"file:{path.resolve()}", "-map", "0:v:0"]


def probe_mp4(path: Path, *, max_frames: int, max_pixels: int | None = None) -> VideoInfo:
    """The first video stream's size (from ffmpeg's stream listing) and frame count (its
    packets listed, nothing decoded; the listing stops past twice ``max_frames`` packets, so
    its size is bounded whatever the index claims). A count past ``max_frames`` or a size past
    ``max_pixels`` is a 413. The stream listing needs ffmpeg's info log level; none of it
    reaches a caller but a sanitized last line."""
    bound = _decoder_bound(max_pixels) if max_pixels else None  # the stream-info pass decodes
    command = [*_ffmpeg_input(path, bound), "-loglevel", "info", "-nostats"]
    command += ["-frames:v", str(2 * max_frames + 2)]  # discarded packets count here too
    # -copyinkf: every packet counts, not only those from the first keyframe on; framecrc
    # lists each packet with its flags, so those an edit list discards (a trimmed clip's
    # lead-in, which no decoder shows) are not counted as frames
    command += ["-copyinkf", "-c", "copy", "-f", "framecrc", "pipe:1"]
    with tempfile.TemporaryFile() as log:
        try:
            run = subprocess.run(
                _bounded(command, PROBE_MEMORY),
                stdout=subprocess.PIPE,
                stderr=log,
                timeout=PROBE_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise _unreadable("probing it timed out") from None
        if run.returncode != 0:
            raise _failure(log, path, PROBE_MEMORY)
        log.seek(0)
        listing = log.read(MAX_PROBE_LOG)
    size = next(filter(None, map(VIDEO_STREAM.match, _lines(listing))), None)
    if size is None:
        raise _unreadable("no video stream size")
    info = VideoInfo(int(size[1]), int(size[2]), _shown_packets(run.stdout))
    if info.frames == 0:  # also what an index past ffmpeg's memory bound leaves, silently
        raise _unreadable("its video stream has no readable frame")
    if info.frames > max_frames:
        raise MediaError(413, f"the MP4 has more than {max_frames} frames (the limit)")
    if max_pixels is not None and info.width * info.height > max_pixels:
        raise MediaError(
            413,
            f"input {info.width}x{info.height} exceeds the limit of {max_pixels} pixels per frame",
        )
    return info


def _shown_packets(listing: bytes) -> int:
    """Packets in framecrc's ``listing`` that a decoder shows: all but those flagged discard
    (``F=0x..`` with ``AV_PKT_FLAG_DISCARD``; a keyframe's line has no flags)."""
    packets = [line for line in listing.splitlines() if line[:1].isdigit()]
    flags = [re.search(rb", F=0x([0-9A-Fa-f]+)", line) for line in packets]
    return sum(1 for f in flags if f is None or not int(f[1], 16) & DISCARD)


def mp4_frames(
    path: Path, info: VideoInfo, *, max_frames: int | None = None
) -> Iterator[np.ndarray]:
    """The first video stream's frames, uint8 ``[H, W, 3]``, decoded one at a time. Each
    frame comes as a PPM (its own size in its header) and must be the probed size, or its
    transpose (ffmpeg applies a display rotation), like every frame before it; past
    ``max_frames`` frames, a 413. ffmpeg's decoders are bounded by the probed size too, and
    its memory by a probe's and a decode's of that size. Closing the iterator early ends
    ffmpeg."""
    pixels = info.width * info.height
    command = [*_ffmpeg_input(path, _decoder_bound(pixels), DECODE_THREADS), "-loglevel", "error"]
    if max_frames is not None:
        command += ["-frames:v", str(max_frames + 1)]
    # every decoded frame once, as the clip holds it: image2pipe's default is a constant frame
    # rate, which repeats and drops the frames of a variable-rate clip (a phone's)
    command += ["-fps_mode", "passthrough"]
    command += ["-c:v", "ppm", "-pix_fmt", "rgb24", "-filter_threads", "1"]
    command += ["-f", "image2pipe", "pipe:1"]
    memory = PROBE_MEMORY + DECODE_MEMORY + DECODE_BYTES_PER_PIXEL * pixels
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(_bounded(command, memory), stdout=subprocess.PIPE, stderr=log)
        try:
            assert proc.stdout is not None
            yield from _within(_ppm_frames(proc.stdout, info, max_frames), proc)
            if proc.wait() != 0:
                raise _failure(log, path, memory)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()


def _within(frames: Iterator[np.ndarray], proc: subprocess.Popen) -> Iterator[np.ndarray]:
    """``frames``, each within ``FRAME_TIMEOUT_S`` of asking for it, else ffmpeg is ended and
    the MP4 refused. Only the wait counts: while the caller holds a frame, ffmpeg waits on a
    full pipe, and that is no stall."""
    stalled = threading.Event()

    def end() -> None:
        stalled.set()
        proc.kill()

    while True:
        timer = threading.Timer(FRAME_TIMEOUT_S, end)
        timer.start()
        try:
            frame = next(frames, None)
        except MediaError:
            if not stalled.is_set():
                raise
            frame = None  # its output cut short by the kill
        finally:
            timer.cancel()
        if stalled.is_set():
            raise _unreadable(f"a frame took more than {FRAME_TIMEOUT_S:g} s to decode")
        if frame is None:
            return
        yield frame


def _bounded(command: list[str], memory: int) -> list[str]:
    """``command`` run with at most ``memory`` bytes of writable memory (RLIMIT_DATA: heap and
    private mappings, thread stacks included; RLIMIT_AS would also count reserved address
    space), set by a shell between fork and exec: ``preexec_fn`` is unsafe in a threaded
    parent (the server), and a limit set once ffmpeg runs (prlimit) would race its demuxer.
    ``exec`` keeps the pid, so ending the process ends ffmpeg. A host's lower hard limit
    makes ulimit fail, and holds. Without a POSIX shell, ``-max_alloc`` is the one bound."""
    if os.name != "posix":
        return command
    script = 'ulimit -S -d "$1" 2>/dev/null; shift; exec "$@"'
    return ["/bin/sh", "-c", script, "sh", str(memory >> 10), *command]


def _decoder_bound(pixels: int) -> int:
    """ffmpeg's ``max_pixels`` for frames of ``pixels``: it checks every picture buffer a
    decoder allocates, padded frames and mpeg4's scratch rows (twice the width) among them,
    so it is loose; the exact check is ours, on each frame's header before its bytes."""
    return 4 * pixels + (1 << 20)


def _ppm_frames(stream: IO[bytes], info: VideoInfo, max_frames: int | None) -> Iterator[np.ndarray]:
    probed = {(info.width, info.height), (info.height, info.width)}
    first: tuple[int, int] | None = None
    count = 0
    while (size := _ppm_header(stream)) is not None:
        if size not in probed or first not in (None, size):
            w, h = size
            raise _unreadable(f"a frame is {w}x{h}, its stream says {info.width}x{info.height}")
        if max_frames is not None and count >= max_frames:
            raise MediaError(413, f"the MP4 has more than {max_frames} frames (the limit)")
        first, count = size, count + 1
        yield _read_frame(stream, size)


def _ppm_header(stream: IO[bytes]) -> tuple[int, int] | None:
    """``P6\\n<w> <h>\\n255\\n`` as ffmpeg's PPM encoder writes it; None at the end."""
    magic = stream.readline(4)
    if not magic:
        return None
    dims, depth = stream.readline(24).split(), stream.readline(8)
    well_formed = magic == b"P6\n" and depth == b"255\n" and len(dims) == 2
    if not (well_formed and all(map(bytes.isdigit, dims))):
        raise _unreadable("ffmpeg's frame stream is malformed")
    return int(dims[0]), int(dims[1])


def _read_frame(stream: IO[bytes], size: tuple[int, int]) -> np.ndarray:
    w, h = size
    frame = np.empty((h, w, 3), np.uint8)
    view, done = memoryview(frame).cast("B"), 0
    while done < len(view):
        got = stream.readinto(view[done:])
        if not got:
            raise _unreadable("a frame is cut short")
        done += got
    return frame


def _lines(log: bytes) -> list[str]:
    return log.decode("utf-8", "replace").splitlines()


def _failure(log: IO[bytes], path: Path, memory: int) -> MediaError:
    """ffmpeg's failure as a caller sees it: past its memory bound (an allocation refused, or
    a thread's stack), a 413 that names the bound; else its last line."""
    log.seek(max(0, log.seek(0, 2) - LOG_TAIL))
    tail = log.read()
    if any(sign in tail for sign in OUT_OF_MEMORY):
        return MediaError(413, f"the MP4 takes more than {memory >> 20} MiB to read (the limit)")
    return _unreadable(_last_line(log, path))


def _last_line(log: IO[bytes], path: Path) -> str:
    """ffmpeg's last stderr line, without addresses or file names."""
    log.seek(max(0, log.seek(0, 2) - LOG_TAIL))
    last = next((line for line in reversed(_lines(log.read())) if line.strip()), "")
    last = PATH.sub("<file>", HEAP_TAG.sub("", last)).replace(str(path.resolve()), "<file>")
    return "".join(c for c in last if c.isprintable()).strip()[:160]
