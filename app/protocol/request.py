"""The decode request: one typed value from the wire to the runner.

``app.protocol`` builds it (every check applied); the HTTP service, ``python -m app decode``
(``app.cli.local_decode``) and the runtime use it unchanged. ``Output`` is the one output vocabulary:
the wire's ``output_type``/``image_format``/``partial_postprocess``/``Accept`` choose one,
the runner reads what to hand back from it, the encoders what to write. A preview never
reaches the runner: the HTTP handler answers it (app/http/preview.py).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from app.families.encoder import Clip

if TYPE_CHECKING:
    from app.families.decoder import VAEDecoder


class Output(enum.Enum):
    """What a decode hands back."""

    IMAGE = "image"  # one encoded image (``DecodeRequest.image_format``), from uint8 frames
    TENSOR = "tensor"  # the decoder's own output space, in the request's dtype (output_type=pt)
    UNIT_TENSOR = "unit_tensor"  # RGB in [0, 1], frames [N,3,H,W] (remote_decode's processor)
    UINT8 = "uint8"  # uint8 frames [N,H,W,3] (partial_postprocess)
    MP4 = "mp4"  # uint8 frames streamed into an H.264 MP4
    PREVIEW = "preview"  # one image from the latent-to-RGB map (app/media/preview.py), no decoder

    @property
    def frames(self) -> bool:
        """Whether the runner hands back frames ([N,...]) rather than the decoder's layout."""
        return self is not Output.TENSOR

    @property
    def uint8(self) -> bool:
        return self in (Output.IMAGE, Output.UINT8, Output.MP4, Output.PREVIEW)


@dataclass(frozen=True)
class Scaling:
    """How the latent is de-normalized before decoding (remote_decode's semantics)."""

    scaling_factor: float | None = None
    shift_factor: float | None = None
    model_default: bool = False  # do_scaling=true without factors

    def apply(self, decoder: VAEDecoder, z: Tensor) -> Tensor:
        if self.scaling_factor is not None or self.shift_factor is not None:
            return z / (self.scaling_factor or 1.0) + (self.shift_factor or 0.0)
        return decoder.denormalize(z) if self.model_default else z


def _frozen(options: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(options))


@dataclass(frozen=True, eq=False)
class DecodeRequest:
    """A validated decode: the latent in the model's layout and everything about its answer.

    ``latent`` is float32 on the CPU, ``[B,C,H,W]`` or ``[B,C,T,H,W]``. ``out_dtype`` is what
    a tensor answer is cast to (the wire dtype; uint8 for image, uint8 and MP4 answers).
    Built by ``app.protocol.validate``; tests and the warm-up build one directly.
    """

    latent: Tensor
    output: Output = Output.UINT8
    scaling: Scaling = field(default_factory=Scaling)
    options: Mapping[str, Any] = field(default_factory=dict)  # family knobs: timestep, seed
    out_dtype: torch.dtype | None = None  # None: uint8 for uint8 outputs, else float32
    image_format: str = ""  # png | jpg | webp, for Output.IMAGE and Output.PREVIEW
    quality: int = 90  # jpg / webp
    fps: float | None = None  # MP4; None: the model's own, else 24
    deadline: float | None = None  # perf_counter time by which the decode must have started
    request_id: str = ""
    wire_shape: tuple[int, ...] = ()  # the latent's shape as sent (the request's log line)
    frame: int = 0  # the latent frame a video latent's preview shows (negative: from the end)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", _frozen(self.options))
        if self.out_dtype is None:
            dtype = torch.uint8 if self.output.uint8 else torch.float32
            object.__setattr__(self, "out_dtype", dtype)
        if not self.wire_shape:
            object.__setattr__(self, "wire_shape", tuple(self.latent.shape))

    @property
    def rows(self) -> int:
        """Latents in the batch."""
        return self.latent.shape[0]

    @property
    def input(self) -> Tensor:
        return self.latent

    def with_input(self, latent: Tensor) -> DecodeRequest:
        """The same request for other rows (a piece of a micro-batch)."""
        return replace(self, latent=latent)

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one decode (a micro-batch)."""
        return (
            tuple(self.latent.shape[1:]),
            self.scaling,
            tuple(sorted(self.options.items())),
            self.output.frames,
            self.output.uint8,
            self.out_dtype,
        )


class LatentFormat(enum.Enum):
    """How an encode's latent is written: remote_encode's raw bytes, or a file format."""

    RAW = "tensor/binary"  # little-endian bytes, ``shape``/``dtype`` headers
    SAFETENSORS = "application/x-safetensors"
    NPY = "application/x-npy"


@dataclass(frozen=True)
class EncodeScaling:
    """How the latent is normalized after encoding: ``(z - shift) * scale`` with explicit
    factors (remote_encode's semantics), else the model's own with ``do_scaling``."""

    scaling_factor: float | None = None
    shift_factor: float | None = None
    model_default: bool = False  # do_scaling=true without factors


@dataclass(frozen=True, eq=False)
class EncodeRequest:
    """A validated encode: RGB pixels in [-1, 1], float32 on the CPU, ``[B,3,H,W]`` or
    ``[B,3,T,H,W]`` (or a ``Clip`` of them), and everything about its answer. Built by
    ``app.protocol.encode``."""

    pixels: Tensor | Clip
    scaling: EncodeScaling = field(default_factory=EncodeScaling)
    sample: bool = False  # a seeded sample of the distribution instead of its mean
    seed: int = 0
    packed: bool = False  # FLUX's packed [B, (H/2)(W/2), 4C] layout
    latent_format: LatentFormat = LatentFormat.RAW
    deadline: float | None = None
    request_id: str = ""
    body_kind: str = "tensor"  # tensor | png | jpeg | webp | mp4: what was sent (the log)

    @property
    def rows(self) -> int:
        """Images (or videos) in the batch."""
        return self.pixels.shape[0]

    @property
    def video(self) -> bool:
        return len(self.pixels.shape) == 5

    @property
    def input(self) -> Tensor | Clip:
        return self.pixels

    def with_input(self, pixels: Tensor) -> EncodeRequest:
        """The same request for other rows (a piece of a micro-batch)."""
        return replace(self, pixels=pixels)

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one encode; a sample is drawn for its own request
        (its seed's noise over its own latent), so it shares with none."""
        own = id(self) if self.sample or not isinstance(self.pixels, Tensor) else None
        return (tuple(self.pixels.shape[1:]), self.scaling, self.packed, own)
