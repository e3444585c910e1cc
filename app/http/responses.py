"""A decode's response body: an encoded image or raw tensor bytes from a finished decode, or
a video's frames streamed as they decode (``tensor_stream``; an MP4: ``app.http.mp4``).

Every answer that can be large goes chunked (no ``Content-Length``: Cloud Run refuses
unchunked responses over 32 MiB): a video's, of any output type, streamed frame by frame
with its frame count and shape in the head; a finished tensor answer over
``CHUNKED_OVER`` bytes (a batch of images as ``pt``), in pieces (``Envelope``).
"""

from __future__ import annotations

import json

import torch
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from app.http.mp4 import JobStream
from app.http.streams import BCTHW, BTCHW, FRAMES, TENSOR_LAYOUTS, TensorStream
from app.media import write
from app.protocol import IMAGE_MIME, ModelGeometry, ProtocolError
from app.protocol.request import DecodeRequest, Output
from app.runtime import Job
from app.telemetry.timing import PhaseTimer

CHUNKED_OVER = 8 << 20  # a finished tensor answer larger than this is sent chunked
TENSOR_MIME = "tensor/binary"


class ChunkedBody(Response):
    """Bytes already made, sent in pieces with no ``Content-Length`` (the server then uses
    chunked transfer encoding). ``body`` stays whole for the request's accounting."""

    def init_headers(self, headers: dict[str, str] | None = None) -> None:
        super().init_headers(headers)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        # one message: ``Envelope`` sends every body in pieces, each under the stall limit
        await send({"type": "http.response.body", "body": self.body, "more_body": False})
        if self.background is not None:
            await self.background()


def encoded(decoded: torch.Tensor, request: DecodeRequest, timer: PhaseTimer) -> Response:
    """The runner's host tensor -> response body, per the request's output (the runner has
    already refused a non-finite decode)."""
    with timer.phase("encode"):
        if request.output is Output.IMAGE:
            data = write.encode_image(decoded[0], request.image_format, request.quality)
            return Response(data, media_type=IMAGE_MIME[request.image_format])
        data, headers = write.tensor_bytes(decoded)
        kind = ChunkedBody if len(data) > CHUNKED_OVER else Response
        return kind(data, media_type=TENSOR_MIME, headers=headers)


def output_label(request: DecodeRequest) -> str:
    """The ``output`` label of the request's metrics: the image format, else the output."""
    return request.image_format if request.output is Output.IMAGE else request.output.value


def streams_frames(request: DecodeRequest) -> bool:
    """Whether the answer is a video's frames streamed as they decode (a ``TensorStream``):
    every output of a video latent but an MP4 (streamed through ffmpeg) and one image."""
    return request.latent.ndim == 5 and request.output in (
        Output.TENSOR,
        Output.UNIT_TENSOR,
        Output.UINT8,
    )


def video_frames(request: DecodeRequest, geometry: ModelGeometry) -> int:
    """Output frames per row of a video latent (a 4-D latent is one latent frame)."""
    latent = request.latent
    return geometry.frames_out(latent.shape[2] if latent.ndim == 5 else 1)


def tensor_layout(asked: str | None) -> str:
    """The ``X-Tensor-Layout`` request header -> the layout of a ``pt`` video answer: the
    decoder's own ``BCTHW`` (the default, what remote_decode reshapes) or ``BTCHW``."""
    if asked is None or not asked.strip():
        return BCTHW
    layout = asked.strip().upper()
    if layout not in TENSOR_LAYOUTS:
        raise ProtocolError(
            422,
            f"X-Tensor-Layout {asked[:16]!r} is not a tensor layout",
            " or ".join(TENSOR_LAYOUTS),
        )
    return layout


def tensor_stream(
    job: Job,
    request: DecodeRequest,
    geometry: ModelGeometry,
    layout: str,
    model: str,
) -> JobStream:
    """A video's frames as raw tensor bytes, each sent as it decodes. The head, sent with the
    first frame, says what the whole body holds: ``shape`` and ``dtype`` (what remote_decode
    reshapes by), ``x-frames`` (every row's frames together) and, for ``pt``,
    ``x-tensor-layout``. The bytes are those of the finished answer's tensor: the decoder's
    own ``[B,3,T,H,W]`` by default (``BCTHW``), ``[B,T,3,H,W]`` when asked (``BTCHW``),
    ``[B*T,3,H,W]`` frames in [0, 1], uint8 ``[B*T,H,W,3]`` for ``partial_postprocess``."""
    latent = request.latent
    rows, frames = latent.shape[0], video_frames(request, geometry)
    h, w = latent.shape[-2] * geometry.spatial_scale, latent.shape[-1] * geometry.spatial_scale
    headers = {"x-model": model, "x-output": output_label(request), "x-frames": str(rows * frames)}
    if request.output is Output.TENSOR:
        shape = [rows, 3, frames, h, w] if layout == BCTHW else [rows, frames, 3, h, w]
        frame_shape, headers["x-tensor-layout"] = (3, h, w), layout
    else:
        frame_shape = (h, w, 3) if request.output is Output.UINT8 else (3, h, w)
        shape, layout = [rows * frames, *frame_shape], FRAMES
    headers["shape"] = json.dumps(shape)
    headers["dtype"] = write.WIRE_NAME[request.out_dtype]
    stream = TensorStream(job, layout, frame_shape, request.out_dtype, rows, frames)
    return JobStream(stream, media_type=TENSOR_MIME, headers=headers)


__all__ = [
    "BCTHW",
    "BTCHW",
    "CHUNKED_OVER",
    "ChunkedBody",
    "encoded",
    "output_label",
    "streams_frames",
    "tensor_layout",
    "tensor_stream",
    "video_frames",
]
