"""A streamed answer's resources and its reader's progress.

``Mp4Stream`` is the body of one MP4 response: frames from the job's channel go into ffmpeg,
MP4 bytes come out. ``TensorStream`` is the body of a streamed tensor answer (a video's
``pt``, ``partial_postprocess`` or ``[N,3,H,W]`` frames): each frame's raw bytes as it is
decoded. However the response ends (done, dropped, failed, client gone, shutdown) ``close``
ends what the body holds at once (an MP4's ffmpeg is killed and reaped) and tells the channel
its reader is done (which gives the stream's slot back). The body runs in a worker thread
(Starlette iterates it in the threadpool) and an aborted response leaves that generator
suspended, so nothing else would end ffmpeg until the garbage collector found the generator.

``ReaderProgress`` says whether the client is reading: the bytes its TCP acknowledged
(``TCP_INFO``), polled while a send waits. A send that waits on a slow reader for a long
time is not a stall: a reader that takes a little is making progress. The kernel's own
buffers are bounded per stream (``SO_SNDBUF``) so that a slow reader's backlog stays small.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Generator, Iterator
from typing import Any

import torch
from starlette.types import Message, Send
from torch import Tensor

from app.media import write
from app.media.mp4 import encode_mp4, reap
from app.runtime.scheduler import Job

log = logging.getLogger("app.http.streams")

TCP_INFO_BYTES_ACKED = 120  # offset of tcpi_bytes_acked (u64) in Linux's struct tcp_info
POLL_S = 1.0  # how often a waiting send looks at the reader's progress (at most)
PIECE_BYTES = 1 << 20  # an answer's body goes out in pieces of this many bytes at most


class StreamAborted(Exception):
    """A response given up midway: raised through the server, which then closes the
    connection without ending the body, so the client sees the truncation."""

    logged = False  # its warning line written where it was given up


class ChannelStream:
    """The body of one streamed answer: the job's decoded chunks, from its channel, as bytes.

    However it ends, ``close`` stops the worker (``Job.abandon``), frees what the body holds
    (``_release``: an MP4's ffmpeg) and tells the channel its reader is done (which gives the
    stream's slot back). ``finished``: the whole body was produced (a closed body just stops).
    """

    kind = "stream"  # the warning line's word for it

    def __init__(self, job: Job) -> None:
        assert job.channel is not None
        self.job = job
        self.threads: int | None = None  # an encoder's threads (the MP4's ffmpeg), if any
        self._lock = threading.Lock()
        self._closed = False
        self._reason = ""  # why close() ended it early, when it did
        self.finished = False
        self._body: Generator[bytes, None, None] | None = None
        # "encode" is the body's own share: the waits for decoded frames (the decoder's own
        # phases) and for the client to read (suspended at yield) are taken out.
        self._elsewhere = 0.0
        job.channel.attach_reader()

    def body(self) -> Iterator[bytes]:
        """The response body (one generator: ``close`` closes it too)."""
        if self._body is None:
            self._body = self._encode()
        return self._body

    def _produce(self) -> Iterator[bytes]:
        """The body's bytes, from ``self._chunks()``."""
        raise NotImplementedError

    def _encode(self) -> Iterator[bytes]:
        started = time.perf_counter()
        try:
            for data in self._produce():
                t0 = time.perf_counter()
                yield data
                self._elsewhere += time.perf_counter() - t0
            self.finished = True
        except Exception as exc:  # the decode failed or the stream was dropped midway
            raise StreamAborted(self._reason or str(exc)) from exc
        finally:
            self.job.timer.add("encode", max(0.0, time.perf_counter() - started - self._elsewhere))
            self.job.abandoned.set()

    def _chunks(self) -> Iterator[Tensor]:
        """The decoded chunks in order, the waits for them not counted as ``encode``."""
        chunks = iter(self.job.channel)
        while True:
            t0 = time.perf_counter()
            try:
                chunk = next(chunks, None)
            finally:
                self._elsewhere += time.perf_counter() - t0
            if chunk is None:
                return
            yield chunk

    @property
    def reason(self) -> str:
        return self._reason

    def _release(self) -> None:
        """Free what the body holds besides its generator (after ``_closed`` is set)."""

    def close(self, reason: str = "") -> None:
        """End everything the stream holds: stop the worker, free the body's resources (the
        body's thread, if it is in a read or write, then sees its pipe close), free the slot."""
        self.job.abandon()
        with self._lock:
            self._closed = True
            self._reason = self._reason or reason
        self._release()
        if self._body is not None:
            with contextlib.suppress(ValueError):  # running in its thread: it sees EOF and ends
                self._body.close()  # else suspended: closing frees its pipes now, not at GC
        self.job.channel.reader_done()


class Mp4Stream(ChannelStream):
    """Frames go into ffmpeg as the worker decodes them; MP4 bytes go out as ffmpeg writes."""

    kind = "MP4 stream"

    def __init__(self, job: Job, fps: float, threads: int | None = None) -> None:
        super().__init__(job)
        self.fps, self.threads = fps, threads
        self._proc: subprocess.Popen | None = None

    def _produce(self) -> Iterator[bytes]:
        yield from encode_mp4(self._frames(), self.fps, threads=self.threads, started=self._started)

    def _frames(self) -> Iterator[Any]:
        for chunk in self._chunks():
            yield from chunk.numpy()

    def _started(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._proc = proc
            closed = self._closed
        if closed:  # the response ended while ffmpeg was starting
            reap(proc)

    def _release(self) -> None:
        with self._lock:
            proc = self._proc
        if proc is not None:
            reap(proc)


# How a streamed tensor answer's bytes are ordered (docs/wire-format.md, "Streamed answers"):
FRAMES = "frames"  # frame-major answers ([N,3,H,W], [N,H,W,3]): each chunk's frames as they come
BCTHW = "BCTHW"  # the decoder's own [B,3,T,H,W], row-major: a row's channel-0 planes stream
#                  as they decode, its channels 1 and 2 follow once the row is decoded
BTCHW = "BTCHW"  # [B,T,3,H,W], row-major: every frame as it decodes (X-Tensor-Layout: BTCHW)
TENSOR_LAYOUTS = (BCTHW, BTCHW)


class TensorStream(ChannelStream):
    """A streamed tensor answer: each decoded frame's raw little-endian bytes as it comes, in
    the order ``layout`` says, its head (``shape``, ``x-frames``) sent before the first.

    ``frame_shape``: one frame's shape on the wire (``[3,H,W]``, ``[H,W,3]``; for ``BCTHW``
    ``[3,H,W]`` too); ``rows`` x ``frames`` frames in all. A chunk that does not fit the head
    (its size, dtype, or more or fewer frames than it said) aborts the stream: a truncated
    body, never a wrong one."""

    kind = "tensor stream"

    def __init__(
        self,
        job: Job,
        layout: str,
        frame_shape: tuple[int, ...],
        dtype: torch.dtype,
        rows: int,
        frames: int,
    ) -> None:
        super().__init__(job)
        self.layout, self.frame_shape, self.dtype = layout, tuple(frame_shape), dtype
        self.rows, self.frames = rows, frames

    def _produce(self) -> Iterator[bytes]:
        done, held = 0, []  # frames so far; BCTHW: the row's channels 1 and 2, until it ends
        for chunk in self._chunks():
            frames = self._frames_of(chunk)
            row_left = self.frames - done % self.frames
            if len(frames) > row_left or done + len(frames) > self.rows * self.frames:
                raise RuntimeError(
                    f"the decode gave more frames than the {self.rows}x{self.frames} the "
                    "answer's head announced"
                )
            for frame in frames:
                yield raw_bytes(frame[0] if self.layout == BCTHW else frame)
            if self.layout == BCTHW:
                held.append(torch.stack([f[1:] for f in frames], 1))  # [2,t,H,W]
            done += len(frames)
            if held and done % self.frames == 0:  # the row is whole: its other two planes
                for channel in range(2):
                    for planes in held:
                        yield raw_bytes(planes[channel])
                held = []
        if done != self.rows * self.frames:
            raise RuntimeError(
                f"the decode gave {done} frames; the answer's head announced "
                f"{self.rows * self.frames}"
            )

    def _frames_of(self, chunk: Tensor) -> list[Tensor]:
        """A chunk's frames, each in the wire's frame shape (``[3,H,W]`` for both tensor
        layouts: a ``[1,3,t,H,W]`` chunk's frame ``i`` is ``chunk[0, :, i]``)."""
        if chunk.dtype != self.dtype:
            raise RuntimeError(f"decoded {chunk.dtype}, the answer's head said {self.dtype}")
        frames = list(chunk[0].unbind(1)) if self.layout in TENSOR_LAYOUTS else list(chunk)
        for frame in frames[:1]:
            if tuple(frame.shape) != self.frame_shape:
                raise RuntimeError(
                    f"decoded frames of {list(frame.shape)}, the answer's head said "
                    f"{list(self.frame_shape)}"
                )
        return frames


def raw_bytes(tensor: Tensor) -> bytes:
    """A tensor's raw little-endian bytes, as a whole tensor answer writes them."""
    return write.tensor_bytes(tensor)[0]


class ReaderProgress:
    """The bytes of a connection its peer has acknowledged, where the server can see them
    (Linux ``TCP_INFO``); ``None`` elsewhere, and then only a finished send is progress. The
    connection's socket is looked up when first needed (a walk of the process's descriptors),
    or at once to give it ``send_buffer`` bytes of kernel send buffer (a stream's)."""

    def __init__(self, scope: dict[str, Any], send_buffer: int | None = None) -> None:
        self._scope: dict[str, Any] | None = scope
        self._sock: socket.socket | None = None
        if send_buffer is not None and (sock := self._socket()) is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)

    def _socket(self) -> socket.socket | None:
        if self._scope is not None:
            self._sock, self._scope = _connection_socket(self._scope), None
        return self._sock

    def acked(self) -> int | None:
        if self._socket() is None:
            return None
        try:
            info = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:
            return None
        if len(info) < TCP_INFO_BYTES_ACKED + 8:
            return None
        return struct.unpack_from("Q", info, TCP_INFO_BYTES_ACKED)[0]

    def drop(self) -> None:
        """End the connection now, unsent bytes and all (a reset, not a close that would wait
        for a reader that reads nothing to take what the server still buffers)."""
        if (sock := self._socket()) is None:
            return
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._scope = None
        if self._sock is not None:
            self._sock.close()  # our duplicate only: the server's descriptor stays open
            self._sock = None


async def send_or_stall(send: Awaitable[None], progress: ReaderProgress, stall_s: float) -> None:
    """Await ``send``; raise ``StreamAborted`` if meanwhile the reader acknowledges nothing
    for ``stall_s``. A send done within a poll (most are) never looks at the reader."""
    task = asyncio.ensure_future(send)
    deadline = time.monotonic() + stall_s
    try:
        done, _ = await asyncio.wait({task}, timeout=min(POLL_S, stall_s))
        if done:
            return task.result()
        last = progress.acked()
        while True:
            remaining = deadline - time.monotonic()
            done, _ = await asyncio.wait({task}, timeout=max(0.0, min(POLL_S, remaining)))
            if done:
                return task.result()
            now = progress.acked()
            if now != last:  # the reader took some: it gets stall_s more
                last, deadline = now, time.monotonic() + stall_s
            elif time.monotonic() >= deadline:
                raise StreamAborted(f"the client read nothing for {stall_s:g} s")
    finally:
        if not task.done():
            task.cancel()


async def send_body(send: Send, message: Message, progress: ReaderProgress, stall_s: float) -> None:
    """One ``http.response.body`` message sent in pieces of at most ``PIECE_BYTES``, each under
    ``send_or_stall``: the server writes a whole message at once, so only between pieces can a
    reader that takes nothing be seen (and its answer's bytes stop in the server's buffer).
    A reader dropped so is reset at once: nothing of its answer stays buffered for it."""
    body, more = message.get("body", b""), message.get("more_body", False)
    view = memoryview(body)
    starts = range(0, len(view), PIECE_BYTES) if len(view) > PIECE_BYTES else [0]
    try:
        for at in starts:
            last = at + PIECE_BYTES >= len(view)
            piece = body if len(starts) == 1 else bytes(view[at : at + PIECE_BYTES])
            message = {"type": "http.response.body", "body": piece, "more_body": more or not last}
            await send_or_stall(send(message), progress, stall_s)
    except StreamAborted:
        progress.drop()
        raise


def _connection_socket(scope: dict[str, Any]) -> socket.socket | None:
    """A duplicate of this request's connection socket, found among the process's descriptors
    by its two addresses (ASGI gives no handle on it); None where that is not possible (no
    /proc, a proxy-rewritten client address, a Unix socket)."""
    client, server = scope.get("client"), scope.get("server")
    if not sys.platform.startswith("linux") or not client or not server:
        return None
    want = ((str(client[0]), int(client[1])), (str(server[0]), int(server[1])))
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return None
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if (
                sock.type == socket.SOCK_STREAM
                and (
                    sock.getpeername()[:2],
                    sock.getsockname()[:2],
                )
                == want
            ):
                return sock
        except OSError:
            pass
        sock.close()
    return None


class _QuietAborts(logging.Filter):
    """Drop the server's traceback for a stream given up on purpose: ``JobStream`` has
    logged it as one warning line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        return not isinstance(exc, StreamAborted)


_quiet = _QuietAborts()


def quiet_aborts() -> None:
    """Install the filter on uvicorn's error logger (idempotent; after any dictConfig)."""
    for name in ("uvicorn.error", "app.service"):  # the server's, and the app's Envelope
        logger = logging.getLogger(name)
        if _quiet not in logger.filters:
            logger.addFilter(_quiet)


def abort_warning(scope: dict[str, Any], model: str, reason: str, kind: str = "MP4 stream") -> None:
    request_id = (scope.get("state") or {}).get("request_id")
    log.warning("%s aborted: request %s, model %s: %s", kind, request_id, model, reason)
