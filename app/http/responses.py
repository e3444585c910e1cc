"""A finished decode -> its response body: an encoded image or raw tensor bytes."""

from __future__ import annotations

import torch
from fastapi.responses import Response

from app.media import write
from app.protocol import IMAGE_MIME
from app.protocol.request import DecodeRequest, Output
from app.telemetry.timing import PhaseTimer


def encoded(decoded: torch.Tensor, request: DecodeRequest, timer: PhaseTimer) -> Response:
    """The runner's host tensor -> response body, per the request's output (the runner has
    already refused a non-finite decode)."""
    with timer.phase("encode"):
        if request.output is Output.IMAGE:
            data = write.encode_image(decoded[0], request.image_format, request.quality)
            return Response(data, media_type=IMAGE_MIME[request.image_format])
        data, headers = write.tensor_bytes(decoded)
        return Response(data, media_type="tensor/binary", headers=headers)


def output_label(request: DecodeRequest) -> str:
    """The ``output`` label of the request's metrics: the image format, else the output."""
    return request.image_format if request.output is Output.IMAGE else request.output.value
