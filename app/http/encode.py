"""``POST /encode``: head -> model -> its encoder -> validated request -> queue -> worker ->
the latent (raw bytes with ``shape``/``dtype`` headers, safetensors or ``.npy``).

The same path as a decode (app/http/decode.py, app/http/handling.py): the event loop never
encodes; the request is a ``Job`` on the worker's queue, with the same deadlines, refusals and
JSON errors. An MP4 body is read by the encoder window by window as it runs, never whole.
"""

from __future__ import annotations

import asyncio
import io

import numpy as np
import torch
from fastapi import Request, Response

from app.http.body import hold, read_body
from app.http.decode import resolve_model
from app.http.errors import runtime_error
from app.http.handling import deadline, handled, outcome
from app.http.serving import Serving
from app.media import write
from app.media.read import Mp4Clip
from app.protocol import ProtocolError
from app.protocol.encode import EncoderGeometry, parse_encode_head, validate_encode
from app.protocol.request import EncodeRequest, LatentFormat
from app.runtime import Job, Runtime, ServedPart
from app.runtime.scheduler import DeviceLost, QueueFull, Stopped
from app.telemetry.timing import PhaseTimer

OUTPUT_LABEL = "latent"  # the output label of an encode's metrics (kind "tensor")


async def handle_encode(request: Request, name: str | None, serving: Serving) -> Response:
    work = lambda timer: _encode(request, name, serving, timer)  # noqa: E731
    return await handled("encode", work, request, name, serving, OUTPUT_LABEL)


async def _encode(
    request: Request, name: str | None, serving: Serving, timer: PhaseTimer
) -> Response:
    settings = serving.settings
    with timer.phase("parse"):
        head = parse_encode_head(list(request.query_params.multi_items()), request.headers.items())
        model = resolve_model(name, head.params.model, serving, "encode")
        served = served_encoder(serving.runtime, model.name)

        async def read(limit: int) -> bytes:
            return await read_body(request, limit, settings.body_timeout_s)

        encode = await validate_encode(
            head,
            EncoderGeometry.of(served.active),
            serving.runtime.limits(served),
            read,
            deadline=deadline(request.state.started, head, settings),
            request_id=request.state.request_id,
        )
        hold(request, input_bytes(encode.pixels))  # the latent answered is smaller
        request.state.shape = list(encode.pixels.shape)
    try:
        latent = await _run(request, serving, Job(served, encode, timer))
    finally:
        if not isinstance(encode.pixels, torch.Tensor):
            encode.pixels.close()  # an MP4 clip: its temporary file and its reader
    response = await asyncio.to_thread(latent_response, latent, encode, timer)
    response.headers["x-model"] = model.name
    response.headers["x-output"] = OUTPUT_LABEL
    return response


async def _run(request: Request, serving: Serving, job: Job) -> torch.Tensor:
    try:
        serving.runtime.submit(job)
    except (QueueFull, Stopped, DeviceLost) as exc:
        raise runtime_error(exc, job.part.name, job.part.part) from None
    return await outcome(request, job, job.future)


def input_bytes(pixels: torch.Tensor | Mp4Clip) -> int:
    """What a parsed encode input holds until its request ends: its pixels, or an MP4's
    temporary file (memory where the filesystem is, as on Cloud Run)."""
    if isinstance(pixels, torch.Tensor):
        return pixels.nbytes
    return pixels.file_bytes


def served_encoder(runtime: Runtime, name: str) -> ServedPart:
    """The model's served encoder; 404 for a decoder-only entry, 503 for one that failed."""
    if name in runtime.encoders:
        return runtime.encoders[name]
    if name in runtime.encoder_errors:
        raise ProtocolError(
            503,
            f"the encoder of model {name!r} is not served: {runtime.encoder_errors[name]}",
            "another model, or this one once it is replaced",
        )
    if not runtime.settings.serve_encoders:
        raise ProtocolError(
            404, "this instance serves no encoders (VAE_SERVE_ENCODERS=false)", "POST /decode"
        )
    with_encoder = ", ".join(sorted(runtime.encoders)) or "none"
    raise ProtocolError(
        404,
        f"model {name!r} holds no encoder (a decoder-only entry): it can decode, not encode",
        f"a model with an encoder ({with_encoder}), or import a checkpoint that has one",
    )


def latent_response(latent: torch.Tensor, request: EncodeRequest, timer: PhaseTimer) -> Response:
    """The latent in the format asked for; every format carries the shape/dtype headers."""
    with timer.phase("encode"):
        data, headers = write.tensor_bytes(latent)
        if request.latent_format is LatentFormat.SAFETENSORS:
            from safetensors.torch import save

            data = save({"latent": latent.contiguous()})
        elif request.latent_format is LatentFormat.NPY:
            buffer = io.BytesIO()
            np.save(buffer, latent.numpy(), allow_pickle=False)
            data = buffer.getvalue()
        return Response(data, media_type=request.latent_format.value, headers=headers)
