"""A latent against its model: layouts, limits and the decoder's working memory.

Everything here runs on shapes first (``layout_shape``, ``check_shape``), so a raw body's
declared shape is refused before a byte of it is read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from app.protocol.bodies import RAW_TYPES, media_type
from app.protocol.errors import ProtocolError
from app.protocol.params import WIRE_DTYPES, DecodeParams
from app.protocol.request import DecodeRequest, Output

if TYPE_CHECKING:
    from app.families.decoder import VAEDecoder

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
TENSOR_MIME = "tensor/binary"


Plan = Callable[[tuple[int, ...]], int]  # a shape -> the bytes a part plans for it


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 256 << 20
    max_pixels: int = 2048 * 2048  # output pixels per frame
    max_frames: int = 257  # output frames per video
    max_batch: int = 8
    max_elements: int = 64 << 20  # latent elements
    max_output_bytes: int = 1 << 30  # the response body (MP4s stream: bounded per frame)
    max_decode_bytes: int = 16 << 30  # the decoder's estimated working memory per request
    # one row's planned memory where the part cannot tile: the most one run could ever hold
    # on this instance (None: it tiles, or nothing bounds it)
    max_run_bytes: int | None = None

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


@dataclass(frozen=True)
class ModelGeometry:
    """What ``validate`` needs to know of the model a request is for."""

    latent_channels: int
    spatial_scale: int
    temporal_scale: int
    is_video: bool
    frames_out: Callable[[int], int]  # latent frames -> output frames
    # latent shape (batch included) -> the decoder's planned working bytes on its device
    planned_bytes: Callable[[tuple[int, ...]], int] = lambda shape: 0
    fps: float | None = None  # the model's own MP4 frame rate, if its config has one
    min_cells: int = 1  # the fewest latent cells along H and W the decoder takes
    # the same, decoded tiled: what the runner falls back to for a latent whose untiled plan
    # exceeds the cap (None: the decoder does not tile)
    tiled_planned_bytes: Callable[[tuple[int, ...]], int] | None = None

    @classmethod
    def of(cls, decoder: VAEDecoder) -> ModelGeometry:
        """The geometry of ``decoder``, its working memory estimated at its own dtype."""
        size = next(decoder.parameters()).element_size()
        fps = decoder.config.get("fps")
        tiled = lambda shape: decoder.planned_bytes(tuple(shape), size, tiled=True)  # noqa: E731
        return cls(
            decoder.latent_channels,
            decoder.spatial_scale,
            decoder.temporal_scale,
            decoder.is_video,
            decoder.frames_out,
            lambda shape: decoder.planned_bytes(tuple(shape), size),
            float(fps) if isinstance(fps, int | float) and not isinstance(fps, bool) else None,
            decoder.min_cells,
            tiled if decoder.supports_tiling else None,
        )


def rows(limits: Limits) -> str:
    """What a 413 for a batch over ``VAE_MAX_BATCH`` expects."""
    return f"at most {limits.max_batch} rows per request (VAE_MAX_BATCH): send the batch in parts"


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
        c = geo.latent_channels
        layout = f"[B,{c},T,H,W] or [B,{c},H,W]" if geo.is_video else f"[B,{c},H,W]"
        packed = len(shape) == 4 and shape[-1] == 4 * c and not geo.is_video
        raise ProtocolError(
            422,
            f"latent has {shape[1]} channels but this model takes {c}",
            layout + (f", or packed [B,N,{4 * c}] with height= and width=" if packed else ""),
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
        from app.families.ops import unpack_tokens

        return unpack_tokens(tensor, params.height, params.width, geo.spatial_scale)
    return tensor.reshape(shape)


def check_declared(
    params: DecodeParams, content_type: str | None, geo: ModelGeometry, limits: Limits, kind: Output
) -> None:
    """A raw body's shape and dtype are in the query: refuse what they describe (too many
    bytes, pixels, frames, output or decoder memory) before a byte of the body is read."""
    if params.shape is None or (media_type(content_type) or TENSOR_MIME) not in RAW_TYPES:
        return
    itemsize = WIRE_DTYPES[params.dtype][1]
    size = math.prod(params.shape) * itemsize
    if size > limits.max_body_bytes:
        raise ProtocolError(
            413,
            f"shape {list(params.shape)} needs {size} bytes; the body limit is "
            f"{limits.max_body_bytes} (VAE_MAX_BODY_MB, within the platform's request limit)",
            f"a body of at most {limits.max_body_bytes} bytes: the latent as bfloat16 or "
            "float16 (half of float32's bytes), or fewer batch rows or frames per request",
        )
    check_shape(layout_shape(params.shape, params, geo), geo, limits, kind, itemsize)


def check_shape(
    shape: Sequence[int], geo: ModelGeometry, limits: Limits, kind: Output, itemsize: int
) -> None:
    """Batch, pixel and frame limits, and what the decode would produce and hold: all from
    the layout shape (``layout_shape``), before anything is allocated."""
    b = shape[0]
    h, w = shape[-2] * geo.spatial_scale, shape[-1] * geo.spatial_scale
    frames = geo.frames_out(shape[2]) if len(shape) == 5 else 1
    if b > limits.max_batch:
        raise ProtocolError(413, f"batch {b} exceeds the limit {limits.max_batch}", rows(limits))
    if h * w > limits.max_pixels:
        raise ProtocolError(
            413,
            f"output {w}x{h} exceeds the limit of {limits.max_pixels} pixels per frame",
            f"at most {limits.max_pixels} pixels per frame (VAE_MAX_PIXELS)",
        )
    if len(shape) == 5 and frames > limits.max_frames:
        raise ProtocolError(
            413,
            f"{frames} output frames exceed the limit {limits.max_frames}",
            f"at most {limits.max_frames} frames (VAE_MAX_FRAMES)",
        )
    output = output_bytes(kind, b * frames * h * w, itemsize)
    if output > limits.max_output_bytes:
        raise ProtocolError(
            413,
            f"the response would be {mib(output)} ({b}x{frames} frames of {w}x{h}, "
            f"{kind.value}); the limit is {mib(limits.max_output_bytes)}",
            "a smaller latent, fewer frames, or output_type=mp4 / partial_postprocess=true",
        )
    check_work(shape, kind, geo, limits, f"decoding {b}x{frames} frames of {w}x{h}")
    if kind is not Output.PREVIEW and min(shape[-2], shape[-1]) < geo.min_cells:
        raise ProtocolError(
            422,
            f"a latent of {shape[-2]}x{shape[-1]} cells is too small for this decoder "
            "(its convolutions pad by reflection)",
            f"at least {geo.min_cells}x{geo.min_cells} latent cells",
        )
    if kind is not Output.PREVIEW:
        check_run(
            geo.planned_bytes((1, *shape[1:])), limits, f"decoding {frames} frames of {w}x{h}"
        )


def check_work(
    shape: Sequence[int], kind: Output, geo: ModelGeometry, limits: Limits, what: str
) -> None:
    """413 for a decode whose plan exceeds ``VAE_MAX_DECODE_MB`` (``check_memory``; an MP4
    streams one video, a preview runs no decoder)."""
    if kind is not Output.PREVIEW:
        hint = "a smaller latent or batch"
        check_memory(tuple(shape), geo.planned_bytes, geo.tiled_planned_bytes, limits, what, hint)


def check_memory(
    shape: tuple[int, ...], planned: Plan, tiled: Plan | None, limits: Limits, what: str, hint: str
) -> None:
    """413 for a run (decode or encode) whose plan exceeds ``VAE_MAX_DECODE_MB``: the part's own
    estimate (the runner plans with the same one), its tiled plan where one row's untiled plan
    exceeds the cap and the part tiles (the runner then runs it tiled)."""
    cap, row = limits.max_decode_bytes, (1, *shape[1:])
    work, over = planned(shape), False
    if work > cap and tiled is not None and planned(row) > cap:
        work, over = tiled(shape), True
    if work > cap:
        raise ProtocolError(
            413,
            f"{what} needs about {mib(work)} of working memory{' even tiled' if over else ''}; "
            f"the limit is {mib(cap)}",
            f"{hint} (or a larger VAE_MAX_DECODE_MB, where the host has it)",
        )


def check_run(row_bytes: int, limits: Limits, what: str) -> None:
    """413 for a run of one row that plans more than this instance could ever hold (a part
    that cannot tile): it never fits, so it is refused before its body, not retried."""
    if limits.max_run_bytes is not None and row_bytes > limits.max_run_bytes:
        raise ProtocolError(
            413,
            f"too large for this instance: {what} needs about {mib(row_bytes)} in one run (this "
            f"model does not tile); one run here can plan at most {mib(limits.max_run_bytes)}",
            "a smaller input",
        )


def output_bytes(kind: Output, pixels: int, itemsize: int) -> int:
    """Bytes of the response for ``pixels`` RGB output pixels (all frames and rows): tensors
    are sent raw; an image is bounded by its raw RGB size; an MP4 streams, frame by frame."""
    per_value = {Output.TENSOR: itemsize, Output.UNIT_TENSOR: itemsize, Output.UINT8: 1}
    # a preview is one frame at the latent's own size: nothing to bound here
    return 3 * pixels * per_value.get(kind, 1 if kind is Output.IMAGE else 0)


def answer_bytes(request: DecodeRequest, geo: ModelGeometry) -> int:
    """The most a decode's whole (not streamed) answer holds: ``output_bytes`` of what its
    latent decodes to, at the answer's dtype."""
    shape = request.latent.shape
    frames = geo.frames_out(shape[2]) if len(shape) == 5 else 1
    pixels = shape[0] * frames * shape[-2] * shape[-1] * geo.spatial_scale**2
    return output_bytes(request.output, pixels, request.out_dtype.itemsize)


def mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def check_limits(
    tensor: Tensor, geo: ModelGeometry, limits: Limits, kind: Output = Output.TENSOR
) -> None:
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
