"""The wire protocol: query params and request bodies -> a validated decode request.

Speaks ``diffusers.utils.remote_utils.remote_decode``'s format (raw little-endian tensor
bytes with ``shape``/``dtype`` params, repeated keys for lists, ``True``/``False`` for
booleans) plus safetensors and ``.npy`` bodies. Everything here is checked before any
allocation sized by the request, and every refusal is a ``ProtocolError`` naming the
problem and what was expected.
"""

from __future__ import annotations

import io
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

WIRE_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "float32": (torch.float32, 4),
    "float16": (torch.float16, 2),
    "bfloat16": (torch.bfloat16, 2),
}
RAW_TYPES = {"tensor/binary", "application/octet-stream"}
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
SAFETENSORS_TYPE = "application/x-safetensors"
NPY_TYPE = "application/x-npy"

OutputKind = Literal["image", "tensor", "unit_tensor", "uint8", "mp4"]
IMAGE_MIME = {"png": "image/png", "jpg": "image/jpeg", "webp": "image/webp"}
ACCEPT_IMAGE = {"image/png": "png", "image/jpeg": "jpg", "image/jpg": "jpg", "image/webp": "webp"}
TENSOR_MIME, MP4_MIME = "tensor/binary", "video/mp4"
IDENTITY_ENCODINGS = {"", "identity"}
MAX_ECHO = 64  # characters of a client's value an error message repeats
MAX_DIM = 1 << 20
FLOAT32_BYTES = 4


class ProtocolError(Exception):
    """A request the service refuses: HTTP status, what was wrong, what was expected."""

    def __init__(self, status: int, error: str, expected: str | None = None) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.expected = expected

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": self.error}
        if self.expected:
            out["expected"] = self.expected
        return out


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 256 << 20
    max_pixels: int = 2048 * 2048  # output pixels per frame
    max_frames: int = 257  # output frames per video
    max_batch: int = 8
    max_elements: int = 64 << 20  # latent elements
    max_output_bytes: int = 1 << 30  # the response body (MP4s stream: bounded per frame)
    max_decode_bytes: int = 16 << 30  # the decoder's estimated working memory per request

    def tightened(self, config: dict[str, Any]) -> Limits:
        """These limits, lowered by a model's own ``max_pixels``/``max_frames``/``max_batch``.

        A manifest can only tighten the server's limits: the server's are sized to its memory.
        """
        own = {k: config.get(k) for k in ("max_pixels", "max_frames", "max_batch")}
        lower = {
            k: min(v, getattr(self, k))
            for k, v in own.items()
            if isinstance(v, int) and not isinstance(v, bool) and v > 0
        }
        return replace(self, **lower) if lower else self


@dataclass
class DecodeParams:
    """The query params, parsed: same names and meanings as remote_decode's."""

    shape: list[int] | None = None
    dtype: str = "float32"
    output_type: str = "pil"
    output_type_given: bool = False  # an explicit output_type wins over Accept
    image_format: str | None = None
    partial_postprocess: bool = False
    scaling_factor: float | None = None
    shift_factor: float | None = None
    do_scaling: bool = False
    height: int | None = None
    width: int | None = None
    fps: float | None = None
    timestep: float | None = None
    seed: int | None = None
    quality: int = 90
    model: str | None = None
    timeout: float | None = None  # seconds the caller waits; the server caps it
    extra: dict[str, str] = field(default_factory=dict)


_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_KNOWN = {
    "shape",
    "dtype",
    "output_type",
    "image_format",
    "partial_postprocess",
    "scaling_factor",
    "shift_factor",
    "do_scaling",
    "height",
    "width",
    "fps",
    "timestep",
    "seed",
    "quality",
    "model",
    "timeout",
    "input_tensor_type",
    "output_tensor_type",
    "return_type",
}


def echo(value: object, limit: int = MAX_ECHO) -> str:
    """A client's value as an error message repeats it: repr'd, clipped to ``limit``."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_params(items: list[tuple[str, str]]) -> DecodeParams:
    """Query items (repeated keys kept) -> ``DecodeParams``, or a 400/422 naming the param."""
    multi: dict[str, list[str]] = {}
    for key, value in items:
        multi.setdefault(key, []).append(value)
    p = DecodeParams(extra={k: v[-1] for k, v in multi.items() if k not in _KNOWN})

    def one(key: str) -> str | None:
        return multi[key][-1] if key in multi else None

    if "shape" in multi:
        p.shape = _parse_shape(multi["shape"])
    p.dtype = (one("dtype") or "float32").lower()
    if p.dtype not in WIRE_DTYPES:
        raise ProtocolError(422, f"dtype {echo(p.dtype)} is not supported", "|".join(WIRE_DTYPES))
    p.output_type = (one("output_type") or "pil").lower()
    p.output_type_given = one("output_type") is not None
    if p.output_type not in ("pil", "pt", "mp4"):
        raise ProtocolError(
            422, f"output_type {echo(p.output_type)} is not supported", "pil|pt|mp4"
        )
    fmt = one("image_format")
    if fmt is not None:
        fmt = {"jpeg": "jpg"}.get(fmt.lower(), fmt.lower())
        if fmt not in IMAGE_MIME:
            raise ProtocolError(422, f"image_format {echo(fmt)} is not supported", "png|jpg|webp")
    p.image_format = fmt
    p.partial_postprocess = _parse_bool("partial_postprocess", one("partial_postprocess"), False)
    p.do_scaling = _parse_bool("do_scaling", one("do_scaling"), False)
    p.scaling_factor = _parse_number("scaling_factor", one("scaling_factor"), float)
    p.shift_factor = _parse_number("shift_factor", one("shift_factor"), float)
    _check_factors_in_float32(p)
    p.height = _parse_number("height", one("height"), int, low=1)
    p.width = _parse_number("width", one("width"), int, low=1)
    p.fps = _parse_number("fps", one("fps"), float, low=0.1, high=240)
    p.timestep = _parse_number("timestep", one("timestep"), float, low=0, high=1000)
    p.seed = _parse_number("seed", one("seed"), int, low=0, high=2**63 - 1)
    p.quality = _parse_number("quality", one("quality"), int, low=1, high=100) or 90
    p.model = one("model")
    p.timeout = parse_timeout("timeout", one("timeout"))
    return p


def parse_timeout(name: str, value: str | None) -> float | None:
    """A deadline in seconds (``timeout`` param or ``X-Request-Timeout`` header), > 0."""
    seconds = _parse_number(name, value, float, low=0.0)
    if seconds is not None and seconds <= 0:
        raise ProtocolError(422, f"{name}={echo(value)} must be positive", "seconds > 0")
    return seconds


def _parse_shape(values: list[str]) -> list[int]:
    text = values[0].strip() if len(values) == 1 else None
    try:
        if text is not None and text.startswith("["):
            dims = json.loads(text)
            if not isinstance(dims, list) or not all(type(d) is int for d in dims):
                raise ValueError
        elif text is not None and "," in text:
            dims = [int(v) for v in text.split(",")]
        else:
            dims = [int(v) for v in values]
        dims = [int(d) for d in dims]
        if any(isinstance(d, bool) for d in dims):
            raise ValueError
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise ProtocolError(
            422,
            f"shape {echo(values)} is not a list of integers",
            "shape=1&shape=16&shape=64&shape=64 or shape=[1,16,64,64]",
        ) from None
    if not 2 <= len(dims) <= 5 or any(d < 1 or d > MAX_DIM for d in dims):
        raise ProtocolError(
            422, f"shape {echo(dims)} is out of range", f"2 to 5 dims, each 1..{MAX_DIM}"
        )
    return dims


def _parse_bool(name: str, value: str | None, default: bool) -> bool:
    if value is None:
        return default
    try:
        return _BOOL[value.strip().lower()]
    except KeyError:
        raise ProtocolError(
            422, f"{name}={echo(value)} is not a boolean", "true|false|1|0"
        ) from None


def _parse_number(
    name: str, value: str | None, kind: type, low: float | None = None, high: float | None = None
) -> Any:
    if value is None or value == "":
        return None
    try:
        number = kind(value)
    except (ValueError, OverflowError):
        raise ProtocolError(
            422, f"{name}={echo(value)} is not a{'n integer' if kind is int else ' number'}"
        ) from None
    if (
        not math.isfinite(number)
        or (low is not None and number < low)
        or (high is not None and number > high)
    ):
        raise ProtocolError(422, f"{name}={echo(value)} is out of range", f"{low}..{high}")
    return number


def _check_factors_in_float32(p: DecodeParams) -> None:
    """The decode divides and shifts in float32: a factor that is 0 or infinite there (1e-50,
    1e39) would turn every pixel into NaN, however finite it is as a Python float."""
    with np.errstate(all="ignore"):
        scale = np.float32(p.scaling_factor if p.scaling_factor is not None else 1.0)
        scale_ok = scale != 0 and np.isfinite(scale) and np.isfinite(np.float32(1) / scale)
        shift_ok = np.isfinite(np.float32(p.shift_factor or 0.0))
    if not scale_ok:
        raise ProtocolError(
            422,
            f"scaling_factor={p.scaling_factor!r} is 0 or infinite (or so is its inverse) "
            "in float32",
            "a non-zero number with it and 1/scaling_factor within float32's range",
        )
    if not shift_ok:
        raise ProtocolError(
            422, f"shift_factor={p.shift_factor!r} overflows float32", "|shift_factor| < 3.4e38"
        )


# --- bodies -------------------------------------------------------------------


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def check_content_encoding(value: str | None) -> None:
    """Bodies are read as sent: a compressed one would be parsed as garbage, so refuse it."""
    if (value or "").strip().lower() not in IDENTITY_ENCODINGS:
        raise ProtocolError(
            415,
            f"Content-Encoding {echo(value)} is not supported",
            "an uncompressed body (no Content-Encoding, or identity)",
        )


def parse_body(content_type: str | None, body: bytes, params: DecodeParams) -> Tensor:
    """The request body -> a float tensor in the wire's dtype (then checked by ``validate``)."""
    kind = media_type(content_type) or "tensor/binary"
    if kind in RAW_TYPES:
        return _parse_raw(body, params)
    if kind == SAFETENSORS_TYPE:
        return _parse_safetensors(body)
    if kind == NPY_TYPE:
        return _parse_npy(body)
    raise ProtocolError(
        415,
        f"Content-Type {echo(kind)} is not supported",
        "tensor/binary, application/octet-stream, application/x-safetensors or application/x-npy",
    )


def _parse_raw(body: bytes, params: DecodeParams) -> Tensor:
    if params.shape is None:
        raise ProtocolError(422, "a raw tensor body needs the shape param", "shape=1&shape=16&...")
    dtype, itemsize = WIRE_DTYPES[params.dtype]
    expected = math.prod(params.shape) * itemsize
    if len(body) != expected:
        raise ProtocolError(
            400,
            f"body is {len(body)} bytes but shape {params.shape} of {params.dtype} "
            f"needs {expected}",
            "little-endian tensor bytes, C order",
        )
    if not body:
        raise ProtocolError(400, "empty body")
    return torch.frombuffer(bytearray(body), dtype=dtype).reshape(params.shape)


def _parse_safetensors(body: bytes) -> Tensor:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(body)
    except (SafetensorError, ValueError, RuntimeError, OverflowError) as exc:
        raise ProtocolError(400, f"body is not a valid safetensors file: {_plain(exc)}") from None
    if len(tensors) != 1:
        raise ProtocolError(400, f"safetensors body holds {len(tensors)} tensors", "exactly one")
    tensor = next(iter(tensors.values()))
    if tensor.dtype not in {d for d, _ in WIRE_DTYPES.values()}:
        raise ProtocolError(
            422, f"tensor dtype {tensor.dtype} is not supported", "float32|float16|bfloat16"
        )
    return tensor


def _parse_npy(body: bytes) -> Tensor:
    """A ``.npy`` body, its header checked against the data before anything is allocated.

    ``np.load`` on a file-like object allocates the header's shape first, so a 100-byte body
    declaring a terabyte array would be honoured: the header is parsed here instead.
    """
    stream = io.BytesIO(body)
    try:
        version = np.lib.format.read_magic(stream)
        read_header = {
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
        }.get(version)
        if read_header is None:
            raise ValueError(f"version {version} is not supported (1.0 or 2.0)")
        shape, fortran_order, dtype = read_header(stream)
    except Exception as exc:  # numpy's header parser raises many types on hostile input
        raise ProtocolError(400, f"body is not a valid .npy file: {_plain(exc)}") from None
    if dtype.kind != "f" or dtype.itemsize not in (2, 4) or dtype.fields is not None:
        raise ProtocolError(422, f".npy dtype {dtype} is not supported", "float32|float16")
    if not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape):
        raise ProtocolError(
            400,
            f".npy header declares shape {echo(list(shape)[:8])}",
            f"a shape of integers, each 0..{MAX_DIM}",
        )
    count = math.prod(shape)
    data = len(body) - stream.tell()
    if count * dtype.itemsize != data:
        raise ProtocolError(
            400,
            f".npy header declares shape {echo(list(shape)[:8])} ({count * dtype.itemsize} bytes) "
            f"but the body holds {data} data bytes",
        )
    if count == 0:
        raise ProtocolError(422, f".npy latent {list(shape)} is empty", "every dim >= 1")
    array = np.frombuffer(body, dtype=dtype, count=count, offset=stream.tell())
    array = array.reshape(shape, order="F" if fortran_order else "C")
    return torch.from_numpy(array.astype(dtype.newbyteorder("="), order="C", copy=True))


_ADDRESS = re.compile(r"<([\w.]+) object at 0x[0-9a-fA-F]+>")


def _plain(exc: BaseException, limit: int = 200) -> str:
    """A parser's message for a client: object reprs without memory addresses, clipped."""
    text = _ADDRESS.sub(r"<\1>", str(exc))
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- validation against a model -------------------------------------------------------


@dataclass(frozen=True)
class ModelGeometry:
    """What ``validate`` needs to know of the model the request is for."""

    latent_channels: int
    spatial_scale: int
    temporal_scale: int
    is_video: bool
    frames_out: Callable[[int], int]  # latent frames -> output frames
    # float32 values the decoder holds per output pixel (per frame) at its peak: its output
    # plus its widest full-resolution activations; see ``peak_channels``
    peak_channels: int = 3 + 2 * 64


def peak_channels(config: dict[str, Any]) -> int:
    """Estimate, from a decoder's config, the float32 values it holds per output pixel at its
    peak: the RGB output, plus the last up stage's input and output activations (conv VAEs:
    ``block_out_channels[1] + [0]`` over the unpatchify area), or a ViT's token state spread
    over its patch. Measured: FLUX.1 at 2048x2048 peaks at 6311 MiB, this says 6192."""
    widths = next(
        (config[k] for k in ("block_out_channels", "decoder_block_out_channels", "channels")
         if isinstance(config.get(k), list) and config[k]),
        None,
    )  # fmt: skip
    patch = int(config.get("patch_size") or 1)
    if widths:
        full = int(widths[0]) + int(widths[1] if len(widths) > 1 else widths[0])
        return 3 + math.ceil(full / patch**2)
    heads, head_dim = (
        config.get("decoder_num_attention_heads"),
        config.get("decoder_attention_head_dim"),
    )
    if isinstance(heads, int) and isinstance(head_dim, int):  # ViT: q, k, v, out, 4x FFN
        area = patch**2 * int(config.get("patch_size_t") or 1)
        return 3 + math.ceil(8 * heads * head_dim / area)
    return ModelGeometry.peak_channels


def layout_shape(shape: Sequence[int], params: DecodeParams, geo: ModelGeometry) -> list[int]:
    """The ``[B,C,H,W]`` / ``[B,C,T,H,W]`` shape a latent of ``shape`` decodes as, checked
    against the model and the geometry params. Needs no tensor: it runs before the body."""
    shape = list(shape)
    if _is_packed(len(shape), params):
        return _packed_layout(shape, params, geo)
    if len(shape) == 3:
        shape = [1, *shape]
    if len(shape) < 4 or len(shape) > 5:
        raise ProtocolError(
            422,
            f"latent of {len(shape)} dims is not a supported layout",
            "[C,H,W], [B,C,H,W], [B,C,T,H,W] or packed [B,N,4C] with height/width",
        )
    if len(shape) == 5 and not geo.is_video:
        raise ProtocolError(422, "this model decodes images; got a 5-D video latent", "[B,C,H,W]")
    if shape[1] != geo.latent_channels:
        raise ProtocolError(
            422,
            f"latent has {shape[1]} channels but this model takes {geo.latent_channels}",
            f"[B,{geo.latent_channels},H,W]",
        )
    _check_geometry_params(shape, params, geo)
    return shape


def _is_packed(ndim: int, params: DecodeParams) -> bool:
    """FLUX packed ``[B,N,4C]`` latents come with height/width; ``[C,H,W]`` ones without."""
    return ndim == 3 and (params.height is not None or params.width is not None)


def _check_geometry_params(shape: list[int], params: DecodeParams, geo: ModelGeometry) -> None:
    """height/width describe packed latents; on any other layout they must agree with it."""
    out_h, out_w = shape[-2] * geo.spatial_scale, shape[-1] * geo.spatial_scale
    for name, asked, actual in (("height", params.height, out_h), ("width", params.width, out_w)):
        if asked is not None and asked != actual:
            raise ProtocolError(
                422,
                f"{name}={asked} does not fit latent {shape}, which decodes to {out_w}x{out_h}",
                f"{name}={actual}, or no {name} (it is for packed [B,N,4C] latents)",
            )


def _packed_layout(shape: list[int], params: DecodeParams, geo: ModelGeometry) -> list[int]:
    b, n, c4 = shape
    if geo.is_video:
        raise ProtocolError(
            422,
            f"packed latent {shape} (height/width given) sent to a video model",
            f"[B,{geo.latent_channels},T,H,W]",
        )
    if params.height is None or params.width is None:
        raise ProtocolError(422, "a packed latent needs both height and width", "height=&width=")
    cell = geo.spatial_scale * 2
    h2, w2 = params.height // cell, params.width // cell
    if c4 != 4 * geo.latent_channels or n != h2 * w2 or h2 == 0 or w2 == 0:
        raise ProtocolError(
            422,
            f"packed latent {shape} does not match height={params.height} width={params.width}",
            f"[B, {max(h2, 1) * max(w2, 1)}, {4 * geo.latent_channels}]",
        )
    return [b, geo.latent_channels, 2 * h2, 2 * w2]


def to_layout(tensor: Tensor, params: DecodeParams, geo: ModelGeometry) -> Tensor:
    """Any accepted layout -> ``[B,C,H,W]`` (image) or ``[B,C,T,H,W]`` (video), checked."""
    shape = layout_shape(tensor.shape, params, geo)
    if _is_packed(tensor.ndim, params):
        from app.decoders.ops import unpack_tokens

        return unpack_tokens(tensor, params.height, params.width, geo.spatial_scale)
    return tensor.reshape(shape)


def check_declared(
    params: DecodeParams, content_type: str | None, geo: ModelGeometry, limits: Limits, kind: str
) -> None:
    """A raw body's shape and dtype are in the query: refuse what they describe (too many
    bytes, pixels, frames, output or decoder memory) before a byte of the body is read."""
    if params.shape is None or (media_type(content_type) or TENSOR_MIME) not in RAW_TYPES:
        return
    itemsize = WIRE_DTYPES[params.dtype][1]
    size = math.prod(params.shape) * itemsize
    if size > limits.max_body_bytes:
        raise ProtocolError(
            413, f"shape {params.shape} needs {size} bytes; the limit is {limits.max_body_bytes}"
        )
    check_shape(layout_shape(params.shape, params, geo), geo, limits, kind, itemsize)


def check_shape(
    shape: Sequence[int], geo: ModelGeometry, limits: Limits, kind: str, itemsize: int
) -> None:
    """Batch, pixel and frame limits, and what the decode would produce and hold: all from
    the layout shape (``layout_shape``), before anything is allocated."""
    b = shape[0]
    h, w = shape[-2] * geo.spatial_scale, shape[-1] * geo.spatial_scale
    frames = geo.frames_out(shape[2]) if len(shape) == 5 else 1
    if b > limits.max_batch:
        raise ProtocolError(413, f"batch {b} exceeds the limit {limits.max_batch}")
    if h * w > limits.max_pixels:
        raise ProtocolError(
            413, f"output {w}x{h} exceeds the limit of {limits.max_pixels} pixels per frame"
        )
    if len(shape) == 5 and frames > limits.max_frames:
        raise ProtocolError(413, f"{frames} output frames exceed the limit {limits.max_frames}")
    pixels = b * frames * h * w
    output = output_bytes(kind, pixels, itemsize)
    if output > limits.max_output_bytes:
        raise ProtocolError(
            413,
            f"the response would be {_mib(output)} ({b}x{frames} frames of {w}x{h}, {kind}); "
            f"the limit is {_mib(limits.max_output_bytes)}",
            "a smaller latent, fewer frames, or output_type=mp4 / partial_postprocess=true",
        )
    # A streamed MP4 holds one latent frame's chunk at a time; anything else, every frame.
    held = b * min(frames, geo.temporal_scale + 1) * h * w if kind == "mp4" else pixels
    work = held * geo.peak_channels * FLOAT32_BYTES
    if work > limits.max_decode_bytes:
        raise ProtocolError(
            413,
            f"decoding {b}x{frames} frames of {w}x{h} needs about {_mib(work)} of working "
            f"memory; the limit is {_mib(limits.max_decode_bytes)}",
            "a smaller latent or batch",
        )


def output_bytes(kind: str, pixels: int, itemsize: int) -> int:
    """Bytes of the response for ``pixels`` RGB output pixels (all frames and rows): tensors
    are sent raw; an image is bounded by its raw RGB size; an MP4 streams, frame by frame."""
    per_value = {"tensor": itemsize, "unit_tensor": itemsize, "uint8": 1, "image": 1}
    return 3 * pixels * per_value.get(kind, 0)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def check_limits(tensor: Tensor, geo: ModelGeometry, limits: Limits, kind: str = "tensor") -> None:
    """``check_shape`` on a parsed latent (in its wire dtype), and finiteness."""
    if tensor.numel() == 0:
        raise ProtocolError(422, f"latent {list(tensor.shape)} is empty", "every dim >= 1")
    check_shape(tensor.shape, geo, limits, kind, tensor.element_size())
    if not torch.isfinite(tensor).all():
        raise ProtocolError(422, "latent contains NaN or Inf values", "finite numbers")


def check_scaling(tensor: Tensor, params: DecodeParams) -> None:
    """Explicit factors must keep the de-normalized latent finite in float32."""
    if params.scaling_factor is None and params.shift_factor is None:
        return
    peak = float(tensor.abs().max()) / abs(params.scaling_factor or 1.0)
    if not peak + abs(params.shift_factor or 0.0) < FLOAT32_MAX:
        raise ProtocolError(
            422,
            "scaling_factor/shift_factor take this latent past the float32 range",
            "factors that keep z / scaling_factor + shift_factor finite",
        )


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


def choose_output(
    params: DecodeParams, accept: str | None, is_video: bool
) -> tuple[OutputKind, str]:
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
        return "mp4", ""
    if params.output_type == "pt":
        return ("uint8", "") if params.partial_postprocess else ("tensor", "")
    # output_type=pil: remote_decode with a processor asks for a [0,1] tensor this way, and
    # so does its video path; a video client may still ask for one frame as an image.
    fmt = params.image_format or ACCEPT_IMAGE.get(best or "")
    if best == TENSOR_MIME or (is_video and fmt is None):
        return "unit_tensor", ""
    return "image", fmt or "png"
