"""Which output a request asks for: ``output_type``, ``image_format`` and ``Accept``."""

from __future__ import annotations

from app.protocol.bodies import media_type
from app.protocol.errors import ProtocolError
from app.protocol.params import DecodeParams
from app.protocol.request import Output

IMAGE_MIME = {"png": "image/png", "jpg": "image/jpeg", "webp": "image/webp"}
ACCEPT_IMAGE = {"image/png": "png", "image/jpeg": "jpg", "image/jpg": "jpg", "image/webp": "webp"}
TENSOR_MIME, MP4_MIME = "tensor/binary", "video/mp4"


def parse_accept(accept: str | None) -> list[str]:
    """An Accept header's media types, most preferred first: q-values honoured, q=0 and
    malformed entries dropped, ties kept in the header's order."""
    ranked: list[tuple[float, int, str]] = []
    for i, entry in enumerate((accept or "").split(",")[:64]):
        kind, *fields = entry.split(";")
        q = 1.0
        for f in fields:
            name, _, value = f.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if kind.strip() and 0 < q <= 1:
            ranked.append((-q, i, media_type(kind)))
    return [kind for _, _, kind in sorted(ranked)]


def choose_output(params: DecodeParams, accept: str | None, is_video: bool) -> tuple[Output, str]:
    """(kind, image format or '') from output_type, image_format and the Accept header.

    An explicit ``output_type`` wins over Accept; without one, the most preferred type this
    model can produce does. remote_decode asks for a [0,1] tensor with ``output_type=pil``
    and ``Accept: tensor/binary`` (and sends image_format too): Accept wins there."""
    producible = {TENSOR_MIME, *ACCEPT_IMAGE}
    if is_video and not params.output_type_given:
        producible.add(MP4_MIME)
    best = next((a for a in parse_accept(accept) if a in producible), None)
    if params.output_type == "mp4" or best == MP4_MIME:
        if not is_video:
            raise ProtocolError(422, "mp4 output needs a video model", "output_type=pil|pt")
        return Output.MP4, ""
    if params.output_type == "preview":  # an image, whatever the model (one video frame)
        return Output.PREVIEW, params.image_format or ACCEPT_IMAGE.get(best or "") or "png"
    if params.output_type == "pt":
        return (Output.UINT8 if params.partial_postprocess else Output.TENSOR), ""
    # output_type=pil: remote_decode with a processor asks for a [0,1] tensor this way, and
    # so does its video path; a video client may still ask for one frame as an image.
    fmt = params.image_format or ACCEPT_IMAGE.get(best or "")
    if best == TENSOR_MIME or (is_video and fmt is None):
        return Output.UNIT_TENSOR, ""
    return Output.IMAGE, fmt or "png"
