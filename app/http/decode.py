"""``POST /decode``: head -> model -> validated request -> queue -> worker -> response.

The event loop never decodes: the handler builds a ``DecodeRequest`` (app.protocol), submits a
``Job`` and awaits its future, or the first frames of a streamed answer (every video answer:
an MP4, or its frames as raw tensor bytes). A preview (``output_type=preview``) is answered
without the queue (app/http/preview.py).
"""

from __future__ import annotations

import asyncio

from fastapi import Request, Response

from app.http.body import hold, read_body
from app.http.errors import runtime_error
from app.http.handling import deadline, handled, outcome
from app.http.mp4 import mp4_response
from app.http.preview import format_of, preview_response
from app.http.responses import (
    encoded,
    output_label,
    streams_frames,
    tensor_layout,
    tensor_stream,
    video_frames,
)
from app.http.serving import Serving
from app.protocol import ProtocolError, parse_head, validate
from app.protocol.errors import echo
from app.protocol.request import Output
from app.protocol.shapes import answer_bytes
from app.runtime import Job, ServedPart
from app.runtime.channel import FrameChannel
from app.runtime.scheduler import DeviceLost, QueueFull, Stopped
from app.store import NAME_RE
from app.telemetry.timing import PhaseTimer


async def handle_decode(request: Request, name: str | None, serving: Serving) -> Response:
    work = lambda timer: _decode(request, name, serving, timer)  # noqa: E731
    return await handled("decode", work, request, name, serving)


async def _decode(
    request: Request, name: str | None, serving: Serving, timer: PhaseTimer
) -> Response:
    settings = serving.settings
    with timer.phase("parse"):
        head = parse_head(list(request.query_params.multi_items()), request.headers.items())
        layout = tensor_layout(request.headers.get("x-tensor-layout"))  # a pt video's bytes
        model = resolve_model(name, head.params.model, serving)
        # refused before the body is read when the model's latents have no published factors
        preview_key = format_of(model) if head.params.output_type == "preview" else None

        async def read(limit: int) -> bytes:
            return await read_body(request, limit, settings.body_timeout_s)

        decode = await validate(
            head,
            model.geometry,
            serving.runtime.limits(model),
            read,
            deadline=deadline(request.state.started, head, settings),
            request_id=request.state.request_id,
            on_shape=lambda shape: setattr(request.state, "shape", shape),
        )
        mp4, frames = decode.output is Output.MP4, streams_frames(decode)
        # the latent and the most its whole answer can be (a stream's frames have a buffer)
        whole = not (mp4 or frames or preview_key)
        answer = answer_bytes(decode, model.geometry) if whole else 0
        hold(request, decode.latent.nbytes + answer)
    if preview_key is not None:  # answered here: milliseconds, no queue, no decoder
        response = await preview_response(preview_key, decode, timer)
        response.headers["x-model"] = model.name
        response.headers["x-output"] = output_label(decode)
        return response
    channel = FrameChannel(settings.stream_buffer_mb << 20, settings.stream_wait_s)
    job = Job(model, decode, timer, channel if mp4 or frames else None)
    try:
        serving.runtime.submit(job)
    except (QueueFull, Stopped, DeviceLost) as exc:
        raise runtime_error(exc, model.name) from None
    if mp4 or frames:
        await outcome(request, job, channel.first)  # errors before the first frame: JSON
        if frames:
            return tensor_stream(job, decode, model.geometry, layout, model.name)
        return mp4_response(job, decode.fps, model.name, video_frames(decode, model.geometry))
    decoded = await outcome(request, job, job.future)
    response = await asyncio.to_thread(encoded, decoded, decode, timer)
    response.headers["x-model"] = model.name
    response.headers["x-output"] = output_label(decode)
    return response


def resolve_model(
    path: str | None, query: str | None, serving: Serving, route: str = "decode"
) -> ServedPart:
    """The model the path names, else ``?model=``, else ``VAE_DEFAULT_MODEL`` (or the only one
    served); a path and a ``?model=`` that disagree are refused, not one of them ignored."""
    runtime = serving.runtime
    if path and query and path != query:
        raise ProtocolError(
            422,
            f"the path names model {echo(path)} and ?model= names {echo(query)}",
            f"one of them: POST /{route}/{{model}} or ?model=",
        )
    name = path or query or serving.settings.default_model
    if name is None and len(runtime.models) == 1:
        name = next(iter(runtime.models))
    if name is None:
        raise ProtocolError(
            400,
            "no model named: the path names none, nor ?model=, and VAE_DEFAULT_MODEL is unset",
            f"POST /{route}/{{model}}, ?model=, or set VAE_DEFAULT_MODEL",
        )
    if not NAME_RE.fullmatch(name):
        raise ProtocolError(404, "invalid model name", "letters, digits, '.', '_', '-'")
    if name in runtime.models:
        return runtime.models[name]
    if runtime.loading:
        raise ProtocolError(503, f"model {name!r} is still loading", "retry after Retry-After")
    if name in runtime.errors:
        raise ProtocolError(
            503,
            f"model {name!r} is not served: {runtime.errors[name]}",
            "another model, or this one once it is replaced",
        )
    what = f"model {name!r}" if path or query else f"VAE_DEFAULT_MODEL's model {name!r}"
    raise ProtocolError(404, f"{what} not found", ", ".join(sorted(runtime.models)))
