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
        raise ProtocolError(422, f"dtype {p.dtype!r} is not supported", "|".join(WIRE_DTYPES))
    p.output_type = (one("output_type") or "pil").lower()
    if p.output_type not in ("pil", "pt", "mp4"):
        raise ProtocolError(422, f"output_type {p.output_type!r} is not supported", "pil|pt|mp4")
    fmt = one("image_format")
    if fmt is not None:
        fmt = {"jpeg": "jpg"}.get(fmt.lower(), fmt.lower())
        if fmt not in IMAGE_MIME:
            raise ProtocolError(422, f"image_format {fmt!r} is not supported", "png|jpg|webp")
    p.image_format = fmt
    p.partial_postprocess = _parse_bool("partial_postprocess", one("partial_postprocess"), False)
    p.do_scaling = _parse_bool("do_scaling", one("do_scaling"), False)
    p.scaling_factor = _parse_number("scaling_factor", one("scaling_factor"), float)
    p.shift_factor = _parse_number("shift_factor", one("shift_factor"), float)
    if p.scaling_factor == 0:
        raise ProtocolError(422, "scaling_factor must be non-zero", "a finite non-zero number")
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
        raise ProtocolError(422, f"{name}={value[:64]!r} must be positive", "seconds > 0")
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
            f"shape {values!r} is not a list of integers",
            "shape=1&shape=16&shape=64&shape=64 or shape=[1,16,64,64]",
        ) from None
    if not 2 <= len(dims) <= 5 or any(d < 1 or d > 1 << 20 for d in dims):
        raise ProtocolError(422, f"shape {dims} is out of range", "2 to 5 dims, each 1..1048576")
    return dims


def _parse_bool(name: str, value: str | None, default: bool) -> bool:
    if value is None:
        return default
    try:
        return _BOOL[value.strip().lower()]
    except KeyError:
        raise ProtocolError(422, f"{name}={value!r} is not a boolean", "true|false|1|0") from None


def _parse_number(
    name: str, value: str | None, kind: type, low: float | None = None, high: float | None = None
) -> Any:
    if value is None or value == "":
        return None
    try:
        number = kind(value)
    except (ValueError, OverflowError):
        raise ProtocolError(
            422, f"{name}={value[:64]!r} is not a{'n integer' if kind is int else ' number'}"
        ) from None
    if (
        not math.isfinite(number)
        or (low is not None and number < low)
        or (high is not None and number > high)
    ):
        raise ProtocolError(422, f"{name}={value[:64]!r} is out of range", f"{low}..{high}")
    return number


# --- bodies -------------------------------------------------------------------


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


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
        f"Content-Type {kind!r} is not supported",
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
        raise ProtocolError(400, f"body is not a valid safetensors file: {exc}") from None
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
        raise ProtocolError(400, f"body is not a valid .npy file: {str(exc)[:200]}") from None
    if dtype.kind != "f" or dtype.itemsize not in (2, 4) or dtype.fields is not None:
        raise ProtocolError(422, f".npy dtype {dtype} is not supported", "float32|float16")
    count = math.prod(shape)
    data = len(body) - stream.tell()
    if count * dtype.itemsize != data:
        raise ProtocolError(
            400,
            f".npy header declares shape {list(shape)[:8]} ({count * dtype.itemsize} bytes) "
            f"but the body holds {data} data bytes",
        )
    array = np.frombuffer(body, dtype=dtype, count=count, offset=stream.tell())
    array = array.reshape(shape, order="F" if fortran_order else "C")
    return torch.from_numpy(array.astype(dtype.newbyteorder("="), order="C", copy=True))


# --- validation against a model -------------------------------------------------------


@dataclass(frozen=True)
class ModelGeometry:
    """What ``validate`` needs to know of the model the request is for."""

    latent_channels: int
    spatial_scale: int
    temporal_scale: int
    is_video: bool
    frames_out: Any  # callable: latent frames -> output frames


def to_layout(tensor: Tensor, params: DecodeParams, geo: ModelGeometry) -> Tensor:
    """Any accepted layout -> ``[B,C,H,W]`` (image) or ``[B,C,T,H,W]`` (video), checked."""
    if tensor.ndim == 3 and params.height is not None and params.width is not None:
        tensor = _unpack(tensor, params, geo)
    elif tensor.ndim == 3:
        tensor = tensor.unsqueeze(0)
    if tensor.ndim < 4 or tensor.ndim > 5:
        raise ProtocolError(
            422,
            f"latent of {tensor.ndim} dims is not a supported layout",
            "[C,H,W], [B,C,H,W], [B,C,T,H,W] or packed [B,N,4C] with height/width",
        )
    if tensor.ndim == 5 and not geo.is_video:
        raise ProtocolError(422, "this model decodes images; got a 5-D video latent", "[B,C,H,W]")
    if tensor.shape[1] != geo.latent_channels:
        raise ProtocolError(
            422,
            f"latent has {tensor.shape[1]} channels but this model takes {geo.latent_channels}",
            f"[B,{geo.latent_channels},H,W]",
        )
    return tensor


def _unpack(tensor: Tensor, params: DecodeParams, geo: ModelGeometry) -> Tensor:
    from app.decoders.ops import unpack_tokens

    b, n, c4 = tensor.shape
    cell = geo.spatial_scale * 2
    h2, w2 = params.height // cell, params.width // cell
    if c4 != 4 * geo.latent_channels or n != h2 * w2 or h2 == 0 or w2 == 0:
        raise ProtocolError(
            422,
            f"packed latent {list(tensor.shape)} does not match height={params.height} "
            f"width={params.width}",
            f"[B, {max(h2, 1) * max(w2, 1)}, {4 * geo.latent_channels}]",
        )
    return unpack_tokens(tensor, params.height, params.width, geo.spatial_scale)


def check_limits(tensor: Tensor, geo: ModelGeometry, limits: Limits) -> None:
    """Batch, pixel and frame limits, and finiteness, before the decode allocates anything."""
    if tensor.numel() == 0:
        raise ProtocolError(422, f"latent {list(tensor.shape)} is empty", "every dim >= 1")
    b = tensor.shape[0]
    h, w = tensor.shape[-2] * geo.spatial_scale, tensor.shape[-1] * geo.spatial_scale
    if b > limits.max_batch:
        raise ProtocolError(413, f"batch {b} exceeds the limit {limits.max_batch}")
    if h * w > limits.max_pixels:
        raise ProtocolError(
            413, f"output {w}x{h} exceeds the limit of {limits.max_pixels} pixels per frame"
        )
    if tensor.ndim == 5:
        frames = geo.frames_out(tensor.shape[2])
        if frames > limits.max_frames:
            raise ProtocolError(413, f"{frames} output frames exceed the limit {limits.max_frames}")
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


def choose_output(
    params: DecodeParams, accept: str | None, is_video: bool
) -> tuple[OutputKind, str]:
    """(kind, image format or '') from output_type, image_format and the Accept header."""
    accepts = [media_type(a) for a in (accept or "").split(",") if a.strip()]
    if params.output_type == "mp4" or "video/mp4" in accepts:
        if not is_video:
            raise ProtocolError(422, "mp4 output needs a video model", "output_type=pil|pt")
        return "mp4", ""
    if params.output_type == "pt":
        return ("uint8", "") if params.partial_postprocess else ("tensor", "")
    # output_type=pil: remote_decode with a processor asks for a [0,1] tensor this way, and
    # so does its video path; a video client may still ask for one frame as an image.
    fmt = params.image_format or next((ACCEPT_IMAGE[a] for a in accepts if a in ACCEPT_IMAGE), None)
    if "tensor/binary" in accepts or (is_video and fmt is None):
        return "unit_tensor", ""
    return "image", fmt or "png"
