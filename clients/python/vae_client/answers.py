"""Reading an answer as it arrives: where its bytes go (a buffer, a file, the numpy array a
tensor answer becomes, filled in place) and how many of its frames are in so far.

A video answer is streamed while the service decodes it, its head saying what the whole body
holds (docs/wire-format.md, "Streamed answers"): ``x-frames`` (every row's frames together),
and for tensors ``shape``, ``dtype`` and, for ``pt``, ``x-tensor-layout``. From those the
frames received are counted from the bytes received (an MP4's from its fragments' sample
counts), so a caller can show progress while the decode runs.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from typing import IO, Any

import httpx
import numpy as np

from vae_client.errors import DecodeError

ProgressCallback = Callable[[int, int], None]  # (frames received so far, frames in all)

# the wire's dtype -> (how its bytes read, the array's dtype): numpy has no bfloat16, so its
# 16-bit words are widened to float32
WIRE_DTYPES: dict[str, tuple[str, type]] = {
    "float32": ("<f4", np.float32),
    "float16": ("<f2", np.float16),
    "bfloat16": ("<u2", np.float32),
    "uint8": ("u1", np.uint8),
}
FRAMES_MAJOR = "BTCHW"  # what the client asks a ``pt`` video answer to be (X-Tensor-Layout)


# --- sinks: one attempt's body goes into one; a retry starts it again ----------------------


class BufferSink:
    """The body in memory: encoded media, returned as bytes."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def start(self, headers: httpx.Headers) -> None:
        self.buffer = bytearray()

    def write(self, data: bytes) -> None:
        self.buffer.extend(data)

    def result(self) -> bytes:
        return bytes(self.buffer)


class FileSink:
    """The body written to an open file as it arrives (from its start on each attempt)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file

    def start(self, headers: httpx.Headers) -> None:
        self.file.seek(0)
        self.file.truncate()

    def write(self, data: bytes) -> None:
        self.file.write(data)


class ArraySink:
    """A tensor answer received into its numpy array as it arrives (no second copy)."""

    def __init__(self) -> None:
        self.receiver: ArrayReceiver | None = None

    def start(self, headers: httpx.Headers) -> None:
        self.receiver = ArrayReceiver(headers)

    def write(self, data: bytes) -> None:
        assert self.receiver is not None
        self.receiver.write(data)

    def result(self) -> np.ndarray:
        assert self.receiver is not None
        return self.receiver.result()


class ArrayReceiver:
    """Fills the array a tensor answer holds (``shape``/``dtype`` headers) from its bytes as
    they come. A ``BTCHW`` answer (a ``pt`` video sent frame by frame: ``[B,T,3,H,W]`` on the
    wire) is put back in the decoder's own ``[B,3,T,H,W]``, frame by frame; bfloat16 is
    widened to float32. ``result`` checks the body was whole."""

    def __init__(self, headers: httpx.Headers) -> None:
        shape = headers.get("shape")
        if shape is None:
            raise DecodeError(None, "the tensor answer has no shape header")
        self.wire_shape = [int(n) for n in json.loads(shape)]
        dtype = headers.get("dtype", "float32")
        if dtype not in WIRE_DTYPES:
            raise DecodeError(None, f"unexpected tensor dtype {dtype!r} in the response")
        wire, out = WIRE_DTYPES[dtype]
        self.wire_dtype, self.widen = np.dtype(wire), dtype == "bfloat16"
        self.frames_major = headers.get("x-tensor-layout", "").upper() == FRAMES_MAJOR
        if self.frames_major and len(self.wire_shape) != 5:
            raise DecodeError(None, f"a {FRAMES_MAJOR} answer of shape {self.wire_shape}")
        if self.frames_major:
            b, t, c, h, w = self.wire_shape
            shape_out, unit = [b, c, t, h, w], c * h * w  # a unit: one frame
        else:
            shape_out, unit = self.wire_shape, math.prod(self.wire_shape[-2:])  # one plane
        self.array = np.empty(shape_out, out)
        self.expected = math.prod(self.wire_shape) * self.wire_dtype.itemsize
        self.received, self.units = 0, 0
        # same bytes, same order: straight into the array; else unit by unit through a buffer
        self._direct = not self.frames_major and not self.widen
        self._bytes = memoryview(self.array.reshape(-1)).cast("B") if self._direct else None
        self._unit = unit
        self._buffer = bytearray(unit * self.wire_dtype.itemsize)
        self._filled = 0

    def write(self, data: bytes) -> None:
        size = len(data)
        if self.received + size > self.expected:
            raise DecodeError(
                None, f"the tensor answer is longer than its shape {self.wire_shape} says"
            )
        if self._bytes is not None:
            self._bytes[self.received : self.received + size] = data
            self.received += size
            return
        view, room = memoryview(data), len(self._buffer)
        while len(view):
            take = min(len(view), room - self._filled)
            self._buffer[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == room:
                self._place()
                self._filled = 0
        self.received += size

    def _place(self) -> None:
        values = np.frombuffer(self._buffer, self.wire_dtype)
        if self.widen:
            values = (values.astype(np.uint32) << 16).view(np.float32)
        if self.frames_major:
            b, t, c, h, w = self.wire_shape
            row, frame = divmod(self.units, t)
            self.array[row, :, frame] = values.reshape(c, h, w)
        else:
            at = self.units * self._unit
            self.array.reshape(-1)[at : at + self._unit] = values
        self.units += 1

    def result(self) -> np.ndarray:
        if self.received != self.expected:
            raise DecodeError(
                None,
                f"the tensor answer holds {self.received} bytes; its shape "
                f"{self.wire_shape} needs {self.expected}",
            )
        return self.array


def sink_for(output: str) -> ArraySink | BufferSink:
    """Where a decode's answer goes: tensors into their array, media into a buffer."""
    return ArraySink() if output in ("tensor", "frames") else BufferSink()


# --- frames received, for progress ---------------------------------------------------------


class FrameCounter:
    """Frames received so far, from the bytes received (``feed`` returns the count)."""

    def __init__(self, total: int) -> None:
        self.total = total

    def feed(self, data: bytes) -> int:
        raise NotImplementedError


class TensorFrames(FrameCounter):
    """A tensor answer: frame-major bodies (``[N,3,H,W]``, ``[N,H,W,3]``, ``BTCHW``) hold a
    frame per ``frame_bytes``; the decoder's own ``[B,3,T,H,W]`` (``BCTHW``) streams each
    row's channel-0 planes frame by frame, then its two other channels at once."""

    def __init__(self, total: int, headers: httpx.Headers) -> None:
        super().__init__(total)
        shape = [int(n) for n in json.loads(headers.get("shape", "[]"))]
        itemsize = np.dtype(WIRE_DTYPES.get(headers.get("dtype", ""), ("<f4", None))[0]).itemsize
        self.received = 0
        self.planar = headers.get("x-tensor-layout", "").upper() == "BCTHW" and len(shape) == 5
        if self.planar:
            self.frames = shape[2]
            self.plane = math.prod(shape[3:]) * itemsize
            self.row = shape[1] * self.frames * self.plane
        else:
            self.frame_bytes = max(1, math.prod(shape) * itemsize // max(1, total))

    def feed(self, data: bytes) -> int:
        self.received += len(data)
        if not self.planar:
            return min(self.total, self.received // self.frame_bytes)
        rows, part = divmod(self.received, self.row)
        return min(self.total, rows * self.frames + min(self.frames, part // self.plane))


class Mp4Frames(FrameCounter):
    """A fragmented MP4: each ``moof`` says how many frames its ``mdat`` holds (its ``trun``
    boxes' sample counts); they count once that ``mdat`` is in."""

    def __init__(self, total: int) -> None:
        super().__init__(total)
        self.done, self._pending = 0, 0
        self._header, self._need = bytearray(), 8  # the current top-level box's header
        self._left: int | None = None  # payload bytes of the current box still to come
        self._kind = b""
        self._moof = bytearray()

    def feed(self, data: bytes) -> int:
        view = memoryview(data)
        while len(view):
            if self._left is None:  # in a box header
                take = min(len(view), self._need - len(self._header))
                self._header += view[:take]
                view = view[take:]
                if len(self._header) == self._need:
                    self._header_done()
                continue
            take = min(len(view), self._left)
            if self._kind == b"moof":
                self._moof += view[:take]
            view = view[take:]
            self._left -= take
            if self._left == 0:
                self._box_done()
        return min(self.total, self.done)

    def _header_done(self) -> None:
        size, kind = struct.unpack(">I4s", self._header[:8])
        if size == 1 and self._need == 8:  # a 64-bit size follows
            self._need = 16
            return
        if size == 1:
            size = struct.unpack(">Q", self._header[8:16])[0]
        left = (1 << 62) if size == 0 else max(0, size - self._need)  # 0: to the end
        self._header, self._need, self._kind, self._left = bytearray(), 8, kind, left
        self._moof = bytearray()
        if left == 0:
            self._box_done()

    def _box_done(self) -> None:
        if self._kind == b"moof":
            self._pending += _samples(bytes(self._moof))
        elif self._kind == b"mdat":
            self.done, self._pending = self.done + self._pending, 0
        self._left, self._kind = None, b""


def _boxes(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(type, payload) of each box in ``data``."""
    at = 0
    while at + 8 <= len(data):
        size, kind = struct.unpack_from(">I4s", data, at)
        head = 8
        if size == 1 and at + 16 <= len(data):
            size, head = struct.unpack_from(">Q", data, at + 8)[0], 16
        elif size == 0:
            size = len(data) - at
        if size < head:
            return
        yield kind, data[at + head : at + size]
        at += size


def _samples(moof: bytes) -> int:
    """The frames one ``moof`` describes: its ``traf``/``trun`` sample counts."""
    return sum(
        struct.unpack_from(">I", trun, 4)[0]
        for kind, traf in _boxes(moof)
        if kind == b"traf"
        for sub, trun in _boxes(traf)
        if sub == b"trun" and len(trun) >= 8
    )


def frame_counter(output: str, headers: httpx.Headers) -> FrameCounter | None:
    """A counter for an answer whose head gives its frame count (``x-frames``: a video's);
    None for the rest (an image's)."""
    total = headers.get("x-frames", "")
    if not total.isdigit() or int(total) == 0:
        return None
    if output == "mp4":
        return Mp4Frames(int(total))
    if output in ("tensor", "frames") and headers.get("shape"):
        return TensorFrames(int(total), headers)
    return None


class Reception:
    """One attempt's answer as it arrives: its bytes into ``sink``, and ``progress`` called
    with the frames received each time their count grows (first with 0, once the head is in;
    last with the total, once the body is whole)."""

    def __init__(
        self, output: str, headers: httpx.Headers, sink: Any, progress: ProgressCallback | None
    ) -> None:
        sink.start(headers)
        self.sink, self.progress = sink, progress
        self.counter = frame_counter(output, headers) if progress is not None else None
        self.done = 0
        if self.counter is not None:
            self.progress(0, self.counter.total)

    def feed(self, data: bytes) -> None:
        self.sink.write(data)
        if self.counter is not None:
            done = self.counter.feed(data)
            if done != self.done:
                self.done = done
                self.progress(done, self.counter.total)

    def end(self) -> None:
        if self.counter is not None and self.done != self.counter.total:
            self.done = self.counter.total
            self.progress(self.done, self.counter.total)
