"""The MP4 response: frames stream into ffmpeg as the worker decodes them, bytes out as
ffmpeg writes them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from app.runtime import Job
from app.video import encode_mp4

log = logging.getLogger("app.service")


class JobStream(StreamingResponse):
    """A streamed job's response. However it ends (done, client gone, error) the worker is
    told to stop, and ``on_close`` gets the bytes sent. A client that reads nothing for
    ``stall_s`` is dropped, and so is a stream the worker gave up: the response is then
    aborted (no terminating chunk), so the client sees the truncation."""

    def __init__(self, job: Job, content: Iterator[bytes], stall_s: float, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.job, self.sent, self.stall_s = job, 0, stall_s
        self.on_close: Callable[[int], None] | None = None
        self.body_iterator = self._counted(self.body_iterator)

    async def _counted(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in body:
            self.sent += len(chunk)
            yield chunk

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watched() -> Message:
            # Stop the worker at once: the cancellation that follows a disconnect only lands
            # once the encoder thread returns, which can be a whole MP4 fragment later.
            message = await receive()
            if message["type"] == "http.disconnect":
                self.job.abandon()
            return message

        async def send_or_drop(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.stall_s)
            except TimeoutError:
                self.job.abandon()
                raise StreamAborted(f"the client read nothing for {self.stall_s:g} s") from None

        try:
            await super().__call__(scope, watched, send_or_drop)
        finally:
            self.job.abandon()
            if self.on_close is not None:
                self.on_close(self.sent)


class StreamAborted(Exception):
    """A streamed response given up midway: raised through the server, which then closes the
    connection without ending the body, so the client sees the truncation."""


def _mp4_response(job: Job, fps: float, model: str, stall_s: float) -> JobStream:
    """Frames go into ffmpeg as the worker decodes them; MP4 bytes go out as ffmpeg writes."""

    # "encode" is ffmpeg's share alone: the waits for decoded frames (the decoder's own
    # phases) and for the client to read (suspended at yield) are taken out.
    elsewhere = 0.0

    def frames() -> Iterator[Any]:
        nonlocal elsewhere
        chunks = iter(job.channel)
        while True:
            t0 = time.perf_counter()
            try:
                chunk = next(chunks, None)
            finally:
                elsewhere += time.perf_counter() - t0
            if chunk is None:
                return
            yield from chunk.numpy()

    def body() -> Iterator[bytes]:
        nonlocal elsewhere
        started = time.perf_counter()
        try:
            for data in encode_mp4(frames(), fps):
                t0 = time.perf_counter()
                yield data
                elsewhere += time.perf_counter() - t0
        except Exception as exc:  # the decode failed or the stream was dropped midway
            log.warning("MP4 stream of model %s aborted: %s", model, exc)
            raise StreamAborted(str(exc)) from exc
        finally:
            job.timer.add("encode", max(0.0, time.perf_counter() - started - elsewhere))
            job.abandoned.set()

    headers = {"x-model": model, "x-output": "mp4"}
    return JobStream(job, body(), stall_s, media_type="video/mp4", headers=headers)
