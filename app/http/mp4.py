"""Streamed responses: ``JobStream`` sends a streamed job's body (an MP4: frames into ffmpeg
as the worker decodes them, bytes out as ffmpeg writes them; or a video's raw tensor frames,
``app.http.responses.tensor_stream``). The stream's resources and the stall rule live in
``app.http.streams``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from app.http.streams import (
    ChannelStream,
    Mp4Stream,
    ReaderProgress,
    StreamAborted,
    abort_warning,
    quiet_aborts,
)
from app.runtime import Job

__all__ = ["JobStream", "StreamAborted", "mp4_response"]


class JobStream(StreamingResponse):
    """A streamed job's response (no Content-Length: chunked). However it ends (done, client
    gone, error) the worker is told to stop, what its body holds is freed (an MP4's ffmpeg is
    reaped: ``ChannelStream.close``) and ``on_close`` gets the bytes sent. A client that
    acknowledges nothing for ``VAE_STREAM_STALL_S`` is dropped (``Envelope``, as for every
    answer; a stream's socket has a small send buffer), and so is a stream the worker gave up:
    the response is then aborted (no terminating chunk), so the client sees the truncation,
    and one warning line says why."""

    def __init__(self, stream: ChannelStream, **kwargs: Any) -> None:
        super().__init__(stream.body(), **kwargs)
        self.stream, self.job, self.sent = stream, stream.job, 0
        self.on_close: Callable[[int], None] | None = None
        self.body_iterator = self._counted(self.body_iterator)

    async def _counted(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in body:
            self.sent += len(chunk)
            yield chunk
        if not self.stream.finished:  # closed midway (a shutdown's cut, a drop): no clean end
            raise StreamAborted(self.stream.reason or "the stream was closed before its end")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        settings = scope["app"].state.settings
        self.stream.threads = settings.encoder_threads
        progress = ReaderProgress(scope, settings.stream_socket_kb << 10)
        scope["state"]["reader"] = progress  # what Envelope's stall limit on every send reads
        quiet_aborts()
        # a shutdown whose grace ran out cuts the stream: its ffmpeg must not outlive us
        cut = asyncio.ensure_future(scope["app"].state.drain.expired.wait())
        cut.add_done_callback(lambda t: t.cancelled() or self.stream.close("shutting down"))

        async def watched() -> Message:
            # Stop the worker at once: the cancellation that follows a disconnect only lands
            # once the encoder thread returns, which can be a whole MP4 fragment later.
            message = await receive()
            if message["type"] == "http.disconnect":
                self.stream.close()
            return message

        try:
            await super().__call__(scope, watched, send)
        except StreamAborted as exc:
            abort_warning(scope, self.job.part.name, str(exc), self.stream.kind)
            exc.logged = True
            raise
        finally:
            cut.cancel()
            progress.close()
            self.stream.close()
            if self.on_close is not None:
                self.on_close(self.sent)


def mp4_response(job: Job, fps: float, model: str, frames: int | None = None) -> JobStream:
    """Frames go into ffmpeg as the worker decodes them; MP4 bytes go out as ffmpeg writes.
    ``frames``: the video's frame count, announced in the head (``x-frames``)."""
    headers = {"x-model": model, "x-output": "mp4"}
    if frames is not None:
        headers["x-frames"] = str(frames)
    return JobStream(Mp4Stream(job, fps), media_type="video/mp4", headers=headers)
