"""The wire protocol: a request's head and body -> a validated ``DecodeRequest``.

Speaks ``diffusers.utils.remote_utils.remote_decode``'s format (raw little-endian tensor
bytes with ``shape``/``dtype`` params, repeated keys for lists, ``True``/``False`` for
booleans) plus safetensors and ``.npy`` bodies (docs/wire-format.md). Two steps, in order:

* ``parse_head(query, headers)`` -> ``Head``: every param and header, model-independent;
* ``validate(head, model, limits, read_body)`` -> ``DecodeRequest``: the output chosen, what
  a raw body declares checked against the model and limits *before* the body is read, then
  the body parsed, laid out and checked again.

Every refusal is a ``ProtocolError`` naming the problem and what was expected.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import torch

from app.protocol import intake
from app.protocol.bodies import check_content_encoding, media_type, parse_body
from app.protocol.errors import ProtocolError, echo
from app.protocol.output import IMAGE_MIME, choose_output, parse_accept
from app.protocol.params import (
    DECODE_PARAMS,
    ENCODE_PARAMS,
    WIRE_DTYPES,
    DecodeParams,
    parse_params,
    parse_timeout,
)
from app.protocol.request import DecodeRequest, Output, Scaling
from app.protocol.shapes import (
    Limits,
    ModelGeometry,
    check_declared,
    check_limits,
    check_scaling,
    layout_shape,
    to_layout,
)

__all__ = [
    "DECODE_PARAMS",
    "ENCODE_PARAMS",
    "IMAGE_MIME",
    "WIRE_DTYPES",
    "DecodeParams",
    "Head",
    "Limits",
    "ModelGeometry",
    "ProtocolError",
    "echo",
    "layout_shape",
    "media_type",
    "parse_accept",
    "parse_body",
    "parse_head",
    "parse_params",
    "validate",
]

BodyReader = Callable[[int], Awaitable[bytes] | bytes]  # the body, refused past this many bytes


@dataclass(frozen=True)
class Head:
    """What a request's params and headers say, parsed and checked."""

    params: DecodeParams
    content_type: str | None = None
    accept: str | None = None
    timeout: float | None = None  # seconds: X-Request-Timeout, else the timeout param


def parse_head(query: list[tuple[str, str]], headers: Iterable[tuple[str, str]] = ()) -> Head:
    """Query items (repeated keys kept) and header pairs (lower-case names, repeats kept)."""
    params = parse_params(query)
    named: dict[str, list[str]] = {}
    for name, value in headers:
        named.setdefault(name.lower(), []).append(value)
    check_content_encoding(named.get("content-encoding", []))
    header_timeout = named.get("x-request-timeout")
    timeout = params.timeout
    if header_timeout is not None:
        timeout = parse_timeout("X-Request-Timeout", header_timeout[0])
    first = {name: values[0] for name, values in named.items()}
    return Head(params, first.get("content-type"), first.get("accept"), timeout)


async def validate(
    head: Head,
    model: ModelGeometry,
    limits: Limits,
    read_body: BodyReader,
    *,
    deadline: float | None = None,
    request_id: str = "",
    on_shape: Callable[[list[int]], None] | None = None,
) -> DecodeRequest:
    """Every check, in order; ``read_body`` is called only once the head's pass."""
    params = head.params
    output, fmt = choose_output(params, head.accept, model.is_video)
    check_declared(params, head.content_type, model, limits, output)  # before the body
    body = read_body(limits.max_body_bytes)
    if inspect.isawaitable(body):
        body = await body
    wire, latent = await intake.parsed(
        _checked_latent, head.content_type, body, params, model, limits, output, on_shape
    )
    frame = _preview_frame(latent, params, output)
    return DecodeRequest(
        latent,
        output,
        Scaling(params.scaling_factor, params.shift_factor, params.do_scaling),
        params.options(),
        torch.uint8 if output.uint8 else wire.dtype,
        fmt,
        params.quality,
        params.fps or model.fps or 24.0,
        deadline,
        request_id,
        tuple(wire.shape),
        frame=frame,
    )


def _checked_latent(
    content_type: str | None,
    body: bytes,
    params: DecodeParams,
    model: ModelGeometry,
    limits: Limits,
    output: Output,
    on_shape: Callable[[list[int]], None] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor as sent, the float32 latent in the decoder's layout) of a body, every check
    that reads its values done: on the intake pool."""
    wire = parse_body(content_type, body, params)
    if on_shape is not None:
        on_shape(list(wire.shape))
    latent = to_layout(wire, params, model)
    check_limits(latent, model, limits, output)
    check_scaling(latent, params)
    _check_output_holds(latent, model, output)
    return wire, latent.float()


def _check_output_holds(latent: torch.Tensor, model: ModelGeometry, output: Output) -> None:
    """An image answer holds one image; an MP4 one video."""
    images = latent.shape[0] * (model.frames_out(latent.shape[2]) if latent.ndim == 5 else 1)
    if output is Output.PREVIEW and latent.shape[0] != 1:
        raise ProtocolError(
            422,
            f"a preview is one image; this latent has a batch of {latent.shape[0]}",
            "batch 1 (a video latent: one frame, picked by frame=)",
        )
    if output is Output.IMAGE and images != 1:
        video = ", or output_type=mp4" if model.is_video else ""  # an image model makes none
        raise ProtocolError(
            422,
            "an image response holds one image; this latent decodes to more",
            f"batch 1 (one frame){video}, or the frames as a tensor "
            "(output_type=pt, or Accept: tensor/binary)",
        )
    if output is Output.MP4 and latent.shape[0] != 1:
        raise ProtocolError(
            422,
            f"an MP4 holds one video; this latent has a batch of {latent.shape[0]}",
            "batch 1, or output_type=pil|pt",
        )


def _preview_frame(latent: torch.Tensor, params: DecodeParams, output: Output) -> int:
    """The latent frame a video latent's preview shows: ``frame`` (negative from the end),
    else the first (ComfyUI's choice). ``frame`` is refused where it means nothing."""
    if params.frame is None:
        return 0
    if output is not Output.PREVIEW or latent.ndim != 5:
        raise ProtocolError(
            422, "frame picks a video latent's preview frame", "output_type=preview, a 5-D latent"
        )
    frames = latent.shape[2]
    if not -frames <= params.frame < frames:
        raise ProtocolError(
            422,
            f"frame={params.frame} is out of range for {frames} latent frames",
            f"{-frames}..{frames - 1}",
        )
    return params.frame
