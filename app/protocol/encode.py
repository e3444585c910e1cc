"""The encode wire protocol: a request's head and body -> a validated ``EncodeRequest``.

Speaks ``diffusers.utils.remote_utils.remote_encode``'s format: a PNG body with no
Content-Type, or raw little-endian tensor bytes with ``shape``/``dtype`` params (pixels in
[-1, 1], what ``VaeImageProcessor.preprocess`` hands ``vae.encode``). Also JPEG/WebP images,
safetensors and ``.npy`` tensors, and ``video/mp4`` for video families (docs/wire-format.md).
What the query and headers declare (a raw tensor's shape) is checked before the body is read;
an image's size is checked from its header, an MP4's from its stream info, before any pixel
is decoded.
"""

from __future__ import annotations

import functools
import inspect
import io
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch
from PIL import Image
from torch import Tensor

from app.families.encoder import VAEEncoder
from app.media import read as media_read
from app.protocol import BodyReader, intake
from app.protocol.bodies import (
    NPY_TYPE,
    RAW_TYPES,
    SAFETENSORS_TYPE,
    check_content_encoding,
    media_type,
    parse_body,
)
from app.protocol.errors import ProtocolError, echo, plain
from app.protocol.output import parse_accept
from app.protocol.params import ENCODE_PARAMS, WIRE_DTYPES, DecodeParams, _bool, parse_params
from app.protocol.params import parse_timeout as _parse_timeout
from app.protocol.request import EncodeRequest, EncodeScaling, LatentFormat
from app.protocol.shapes import Limits, check_memory, check_run, rows

IMAGE_TYPES = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg", "image/webp": "webp"}
MP4_TYPES = {"video/mp4"}
PIL_FORMATS = {name: name.lower() for name in media_read.IMAGE_FORMATS}
ACCEPT_LATENT = {f.value: f for f in LatentFormat}
BODY_TYPES = "image/png, image/jpeg, image/webp, video/mp4 (video models), tensor/binary"
BODY_TYPES += f" (with shape and dtype), {SAFETENSORS_TYPE} or {NPY_TYPE}"


@dataclass(frozen=True)
class EncodeHead:
    """What an encode request's params and headers say, parsed and checked."""

    params: DecodeParams  # the names encode shares with decode (shape, dtype, factors, ...)
    sample: bool = False
    packed: bool = False
    content_type: str | None = None
    accept: str | None = None
    timeout: float | None = None


@dataclass(frozen=True)
class EncoderGeometry:
    """What ``validate_encode`` needs to know of the encoder a request is for."""

    family: str
    spatial_scale: int
    is_video: bool
    planned_bytes: Callable[[tuple[int, ...]], int]
    frames_problem: Callable[[int], str] = lambda frames: ""  # "": encodable
    min_cells: int = 1  # the fewest latent cells along H and W the encoder makes
    # the same, encoded tiled (where one input's untiled plan exceeds the cap the runner
    # tiles); None: the encoder does not tile
    tiled_planned_bytes: Callable[[tuple[int, ...]], int] | None = None

    @classmethod
    def of(cls, encoder: VAEEncoder) -> EncoderGeometry:
        size = next(encoder.parameters()).element_size()
        tiled = lambda shape: encoder.planned_bytes(tuple(shape), size, tiled=True)  # noqa: E731
        return cls(
            encoder.family,
            encoder.spatial_scale,
            encoder.is_video,
            lambda shape: encoder.planned_bytes(tuple(shape), size),
            encoder.frames_problem,
            encoder.min_cells,
            tiled if encoder.supports_tiling else None,
        )


def parse_encode_head(
    query: list[tuple[str, str]], headers: Iterable[tuple[str, str]] = ()
) -> EncodeHead:
    """Query items and header pairs -> ``EncodeHead``; an unknown param is a 422."""
    own = {"sample": None, "packed": None}
    shared = []
    for key, value in query:
        if key in own:
            own[key] = value
        else:
            shared.append((key, value))
    params = parse_params(shared, ENCODE_PARAMS)
    named: dict[str, list[str]] = {}
    for name, value in headers:
        named.setdefault(name.lower(), []).append(value)
    check_content_encoding(named.get("content-encoding", []))
    timeout = params.timeout
    if "x-request-timeout" in named:
        timeout = _parse_timeout("X-Request-Timeout", named["x-request-timeout"][0])
    first = {name: values[0] for name, values in named.items()}
    sample, packed = _bool("sample", own["sample"]), _bool("packed", own["packed"])
    if params.seed is not None and not sample:
        raise ProtocolError(422, "seed without sample=true", "sample=true&seed=N, or neither")
    return EncodeHead(
        params, sample, packed, first.get("content-type"), first.get("accept"), timeout
    )


def _finite_float(tensor: torch.Tensor) -> torch.Tensor:
    pixels = tensor.float()
    if not bool(torch.isfinite(pixels).all()):
        raise ProtocolError(422, "the pixels hold NaN or infinity", "RGB in [-1, 1]")
    return pixels


async def validate_encode(
    head: EncodeHead,
    geo: EncoderGeometry,
    limits: Limits,
    read_body: BodyReader,
    *,
    deadline: float | None = None,
    request_id: str = "",
) -> EncodeRequest:
    """Every check, in order; ``read_body`` is called only once the head's pass."""
    latent_format = _latent_format(head.accept)
    kind = _declared_kind(head, geo)
    if head.packed and geo.family != "flux":
        raise ProtocolError(422, "packed=true is FLUX's layout", "a flux-family model")
    if kind == "raw":
        _check_pixels(head.params.shape, head.params.dtype, geo, limits, head.packed)
    body = read_body(limits.max_body_bytes)
    if inspect.isawaitable(body):
        body = await body
    if not body:
        raise ProtocolError(400, "empty body", BODY_TYPES)
    if kind == "sniff":
        kind = _sniff(body)
    if kind in ("png", "jpeg", "webp"):
        multiple = geo.spatial_scale * (2 if head.packed else 1)
        pixels = await intake.parsed(read_image, body, kind, multiple, geo, limits)
    elif kind == "mp4":
        pixels = await intake.parsed(read_mp4, body, geo, limits)
    else:
        content_type = head.content_type if kind != "raw" else "tensor/binary"
        tensor = await intake.parsed(parse_body, content_type, body, head.params)
        _check_pixels(tuple(tensor.shape), _wire_name(tensor.dtype), geo, limits, head.packed)
        pixels = await intake.parsed(_finite_float, tensor)
    params = head.params
    return EncodeRequest(
        pixels,
        EncodeScaling(params.scaling_factor, params.shift_factor, params.do_scaling),
        head.sample,
        params.seed or 0,
        head.packed,
        latent_format,
        deadline,
        request_id,
        kind if kind in ("png", "jpeg", "webp", "mp4") else "tensor",
    )


def _latent_format(accept: str | None) -> LatentFormat:
    """The first Accept type that names a latent format; raw bytes otherwise (remote_encode
    sends no Accept)."""
    return next((ACCEPT_LATENT[a] for a in parse_accept(accept) if a in ACCEPT_LATENT), None) or (
        LatentFormat.RAW
    )


def _declared_kind(head: EncodeHead, geo: EncoderGeometry) -> str:
    """raw | safetensors | npy | png | jpeg | webp | mp4, or sniff (no Content-Type, no
    shape: remote_encode's PNG, told from the body's magic bytes)."""
    kind = media_type(head.content_type)
    if not kind:
        return "raw" if head.params.shape is not None else "sniff"
    if kind in RAW_TYPES:
        if head.params.shape is None:
            raise ProtocolError(
                422, "a raw tensor body needs the shape param", "shape=1&shape=3&..."
            )
        return "raw"
    if kind == SAFETENSORS_TYPE:
        return "safetensors"
    if kind == NPY_TYPE:
        return "npy"
    if kind in IMAGE_TYPES:
        return IMAGE_TYPES[kind]
    if kind in MP4_TYPES:
        if not geo.is_video:
            raise ProtocolError(
                415, "video/mp4 needs a video model", "an image (png/jpeg/webp) or a tensor"
            )
        return "mp4"
    raise ProtocolError(415, f"Content-Type {echo(kind)} is not supported", BODY_TYPES)


def _sniff(body: bytes) -> str:
    if body.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if body.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if body[:4] == b"RIFF" and body[8:12] == b"WEBP":
        return "webp"
    raise ProtocolError(
        415,
        "a body without Content-Type is not a PNG, JPEG or WebP image",
        "an image, or a raw tensor with the shape and dtype params",
    )


def _wire_name(dtype: torch.dtype) -> str:
    return next((name for name, (d, _) in WIRE_DTYPES.items() if d == dtype), "float32")


def _check_pixels(
    shape: tuple[int, ...] | None,
    dtype: str,
    geo: EncoderGeometry,
    limits: Limits,
    packed: bool,
) -> None:
    """A pixel tensor's shape against the encoder and the limits (before the body where the
    shape is declared): ``[B,3,H,W]``, or ``[B,3,T,H,W]`` for a video encoder."""
    assert shape is not None
    layouts = "[B,3,H,W] or [B,3,T,H,W]" if geo.is_video else "[B,3,H,W]"
    if len(shape) not in ((4, 5) if geo.is_video else (4,)) or shape[1] != 3:
        raise ProtocolError(422, f"pixels of shape {list(shape)} are not {layouts}", layouts)
    b, h, w = shape[0], shape[-2], shape[-1]
    frames = shape[2] if len(shape) == 5 else 1
    itemsize = WIRE_DTYPES[dtype][1]
    if math.prod(shape) * itemsize > limits.max_body_bytes:
        raise ProtocolError(
            413,
            f"pixels {list(shape)} exceed the body limit of {limits.max_body_bytes} bytes "
            "(VAE_MAX_BODY_MB, within the platform's request limit)",
            "the image as PNG, JPEG or WebP, or the video as an MP4, instead of a raw pixel "
            "tensor; or fewer batch rows per request",
        )
    _check_size(b, frames, h, w, geo, limits)
    scale = geo.spatial_scale * (2 if packed else 1)
    if (geo.is_video or packed) and (h % scale or w % scale):
        raise ProtocolError(
            422, f"pixels {w}x{h} are not a multiple of {scale}", f"H and W multiples of {scale}"
        )


def _check_size(b: int, frames: int, h: int, w: int, geo: EncoderGeometry, limits: Limits) -> None:
    if b > limits.max_batch:
        raise ProtocolError(413, f"batch {b} exceeds the limit {limits.max_batch}", rows(limits))
    if h * w > limits.max_pixels:
        raise ProtocolError(
            413,
            f"input {w}x{h} exceeds the limit of {limits.max_pixels} pixels per frame",
            f"at most {limits.max_pixels} pixels per frame (VAE_MAX_PIXELS)",
        )
    if frames > limits.max_frames:
        raise ProtocolError(
            413,
            f"{frames} input frames exceed the limit {limits.max_frames}",
            f"at most {limits.max_frames} frames (VAE_MAX_FRAMES)",
        )
    shape = (b, 3, frames, h, w) if geo.is_video and frames > 1 else (b, 3, h, w)
    what = f"encoding {b}x{frames} frames of {w}x{h}"
    check_memory(shape, geo.planned_bytes, geo.tiled_planned_bytes, limits, what, "a smaller input")
    check_run(geo.planned_bytes((1, *shape[1:])), limits, f"encoding {frames} frames of {w}x{h}")
    if min(h, w) < geo.spatial_scale * geo.min_cells:
        cells = "one latent cell" if geo.min_cells == 1 else f"{geo.min_cells} latent cells"
        least = geo.spatial_scale * geo.min_cells
        raise ProtocolError(422, f"input {w}x{h} is smaller than {cells}", f">= {least} px")
    if geo.is_video and (problem := geo.frames_problem(frames)):
        raise ProtocolError(
            422,
            f"the {geo.family} encoder refuses {frames} frames: {problem}",
            "a frame count the rule above allows",
        )


P = ParamSpec("P")
R = TypeVar("R")


def _memory_is_503(read: Callable[P, R]) -> Callable[P, R]:
    """Running out of memory while reading a body is the server's state, not the request's
    fault: a 503, which the HTTP layer answers with Retry-After."""

    @functools.wraps(read)
    def reading(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return read(*args, **kwargs)
        except MemoryError:
            raise ProtocolError(
                503, "the server ran out of memory reading the body", "retry after Retry-After"
            ) from None

    return reading


# what a 422 for a JPEG past media_read.MAX_JPEG_SCANS (held by ``rgb_image``) expects
SCANS_EXPECTED = (
    f"at most {media_read.MAX_JPEG_SCANS} scans (a baseline or an encoder's progressive JPEG)"
)


@_memory_is_503
def read_image(
    body: bytes, kind: str, multiple: int, geo: EncoderGeometry, limits: Limits
) -> Tensor:
    """An image body -> ``[1,3,H,W]`` in [-1, 1], as ``VaeImageProcessor.preprocess`` makes
    it (RGB, 16-bit grey scaled to 8 bits; sizes rounded down to ``multiple`` with Lanczos;
    ``2 * x/255 - 1``). The size is checked from the header, before the pixels are decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(body), formats=list(PIL_FORMATS))
    except MemoryError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ProtocolError(  # Pillow's own bound, past ours: still before any pixel
            413,
            f"image exceeds the limit of {limits.max_pixels} pixels per frame: {exc}"[:240],
            "a smaller image",
        ) from None
    except Exception as exc:  # Pillow raises many types on a broken header
        raise ProtocolError(
            400, f"body is not a valid {kind} image: {plain(exc)}", "a PNG, JPEG or WebP image"
        ) from None
    w, h = image.size
    _check_size(1, 1, h, w, geo, limits)
    try:
        rgb = media_read.rgb_image(image)
    except MemoryError:
        raise
    except media_read.MediaError as exc:  # a JPEG past the scan limit, whatever declared
        raise ProtocolError(exc.status, str(exc), SCANS_EXPECTED) from None
    except Exception as exc:  # truncated or corrupt data past the header
        raise ProtocolError(
            400, f"the {kind} image cannot be decoded: {plain(exc)}", "a whole PNG, JPEG or WebP"
        ) from None
    return _to_pixels([rgb], multiple)


def _to_pixels(frames: list[Image.Image], multiple: int) -> Tensor:
    """RGB frames -> ``[1,3,H,W]`` (one) or ``[1,3,T,H,W]`` in [-1, 1]."""
    try:
        pixels = media_read.to_pixels(frames, multiple).unsqueeze(0)
    except media_read.MediaError as exc:
        raise ProtocolError(exc.status, exc.message, f">= {multiple} px") from None
    return pixels[:, :, 0] if len(frames) == 1 else pixels.contiguous()


@_memory_is_503
def read_mp4(body: bytes, geo: EncoderGeometry, limits: Limits) -> media_read.Mp4Clip:
    """An MP4 body -> a clip the encoder reads window by window (``app.media.read.Mp4Clip``:
    the container forced to MP4, nothing else opened, the frames decoded as the encoder asks
    for them and never all held). The frame count and size are probed and checked before
    any frame is decoded, and the encoder's working memory and frame rule with the first
    frame's size before the request is queued; decoding stops at ``max_frames`` whatever the
    probe counted."""
    try:
        clip = media_read.Mp4Clip(
            body,
            max_frames=limits.max_frames,
            max_pixels=limits.max_pixels,
            multiple=geo.spatial_scale,
        )
    except media_read.MediaError as exc:
        if exc.status == 413:
            expected = f"at most {limits.max_frames} frames of at most {limits.max_pixels} pixels"
            raise ProtocolError(413, exc.message, expected) from None
        message = f"the body is {exc.message}" if exc.status == 400 else exc.message
        raise ProtocolError(exc.status, message, "an H.264, HEVC, VP9 or AV1 MP4") from None
    try:
        _, _, frames, h, w = clip.shape
        _check_size(1, frames, h, w, geo, limits)
    except BaseException:
        clip.close()
        raise
    return clip
