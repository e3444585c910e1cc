"""``output_type=preview``: the latent-to-RGB map (app/media/preview.py) answered by the handler
itself, in a thread off the event loop: no queue, no decode worker, no decoder."""

from __future__ import annotations

import asyncio

import torch
from fastapi.responses import Response

from app.families import family
from app.media import write
from app.media.preview import FORMATS, preview
from app.media.preview_factors import FACTORS
from app.protocol import IMAGE_MIME, ProtocolError
from app.protocol.request import DecodeRequest
from app.runtime import ServedPart
from app.telemetry.timing import PhaseTimer

CONFIG_KEY = "preview_format"  # a manifest config's own choice, one of FORMATS


def preview_format(family_key: str, config: dict, latent_channels: int) -> str | None:
    """The format whose factors preview a model's latents: the config's ``preview_format``,
    else the family's own choice (its descriptor's ``preview``); None where nothing is
    published (LTX-2, Wan 2.2, MiniMax-H3)."""
    if config.get(CONFIG_KEY) is not None:
        return str(config[CONFIG_KEY])
    return family(family_key).preview(config, latent_channels)


def format_of(model: ServedPart) -> str:
    """The published format that previews ``model``'s latents, or a 422 naming the ones."""
    decoder = model.reference
    channels = decoder.latent_channels
    key = preview_format(model.manifest.family, decoder.config, channels)
    if key is None or key not in FORMATS or len(FACTORS[key][0]) != channels:
        # a manifest's preview_format can name an unknown format, or one of other channels
        what = f"preview_format {key!r}" if key else f"family {model.manifest.family!r}"
        raise ProtocolError(
            422,
            f"model {model.name!r} has no published preview factors ({what}, "
            f"{channels} latent channels)",
            "a model of a format with published factors: " + ", ".join(FORMATS),
        )
    return key


async def preview_response(key: str, request: DecodeRequest, timer: PhaseTimer) -> Response:
    """The preview image of ``request``'s latent (as sent: no de-normalization)."""
    return await asyncio.to_thread(_encoded, key, request, timer)


def _encoded(key: str, request: DecodeRequest, timer: PhaseTimer) -> Response:
    with timer.phase("preview"):
        pixels = preview(key, request.latent, frame=request.frame)[0]
        data = write.encode_image(torch.from_numpy(pixels), request.image_format, request.quality)
    return Response(data, media_type=IMAGE_MIME[request.image_format])
