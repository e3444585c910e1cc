"""The one interface every decoder family implements.

A decoder is the ``decoder/`` sub-package of its family's package
(``app/families/<package>/decoder/``, docs/decoders.md); it exports:

* ``Decoder``: a ``VAEDecoder`` subclass built from a plain JSON config dict.
  Its ``state_dict()`` names are the canonical names of the model store.
* ``convert(source: Path) -> tuple[dict, dict[str, Tensor]]``: read a checkpoint
  (diffusers folder or an original single file) and return ``(config,
  decoder-only state dict in canonical names)``. Used by ``python -m app import``.
* ``SYNTHETIC: dict[str, dict]`` (store name -> config; may be empty) and
  ``init_synthetic(decoder, generator)``, from ``synthetic.py``: the embedded models of
  ``python -m app bake --synthetic`` (required: tests/test_layout.py checks every family).

The service never needs to know which family it is serving.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from app.families import winograd

# What ``decode`` returns, before any post-processing:
#   "signed"   RGB in [-1, 1] (flux, ltx)
#   "imagenet" ImageNet-normalized RGB (minimax-h3)
#   "unit"     RGB in [0, 1] (taesd)
OutputSpace = Literal["signed", "imagenet", "unit"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class VAEDecoder(nn.Module, ABC):
    """A resident VAE decoder: latents in, pixels out, stages timed."""

    family: ClassVar[str]  # the family key: set by its descriptor (app/families/descriptor.py)
    output_space: ClassVar[OutputSpace] = "signed"
    is_video: ClassVar[bool] = False
    # a served copy on the CPU lays its conv weights channels-last (modes.set_channels_last)
    channels_last: ClassVar[bool] = False
    # True when ``decode`` takes ``tiled``: None = the family's own default, True = decode in
    # tiles/bands (less memory, the out-of-memory retry), False = never tile.
    supports_tiling: ClassVar[bool] = False
    exact_tiling: ClassVar[bool] = False  # tiled=True computes the same function (FLUX's bands)
    # The family's CPU fast path opts its 3x3 convs of at most this many channels into
    # Winograd (``winograd.prepare``); 0: none. Wider convs keep the direct kernels.
    winograd_max_channels: ClassVar[int] = 0
    # What samplers render with this family (pixels, H x W; video: latent frames too): the
    # gate's full-resolution check (``full_latent``) decodes a latent of that size.
    native_size: ClassVar[tuple[int, int]] = (1024, 1024)
    native_latent_frames: ClassVar[int] = 3
    # ``working_bytes`` is measured on the meta device, which sees op outputs only; on the CPU
    # oneDNN also holds its own copies of a conv's input and output (its blocked layout, a
    # padded input's copy): the CPU plans ``cpu_margin`` times the estimate (measured per
    # family: tests/test_decoder_cpu_memory.py, docs/decoders.md).
    cpu_margin: ClassVar[float] = 1.0
    # On a GPU the caching allocator's peak also holds what the meta device never sees
    # (cuDNN's workspaces, the allocator's rounding): a GPU plans ``gpu_margin`` times the
    # estimate, measured per family by the GPU proof (docs/decoders.md, "On a GPU"); this
    # default, for a family not measured there, is the convolutional families' measured ratio.
    gpu_margin: ClassVar[float] = 1.35

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        # ``config`` None: a family's ``model.Architecture`` (first in the MRO) sets it
        super().__init__()
        if config is not None:
            self.config = dict(config)

    # --- geometry -------------------------------------------------------
    @property
    @abstractmethod
    def latent_channels(self) -> int:
        """Channels of the (unpacked) latent this decoder takes."""

    @property
    @abstractmethod
    def spatial_scale(self) -> int:
        """Pixels per latent cell along H and W."""

    @property
    def min_cells(self) -> int:
        """The fewest latent cells along H and W a decode takes: 2 where a conv pads the
        latent-sized map by reflection (one cell has nothing to reflect; the reference fails)."""
        return 1

    @property
    def temporal_scale(self) -> int:
        """Frames per latent frame (video decoders)."""
        return 1

    def frames_out(self, latent_frames: int) -> int:
        """Frames decoded from ``latent_frames`` (video decoders override)."""
        return latent_frames

    def working_bytes(
        self, latent_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        """Peak device bytes of one ``decode`` of a latent of ``latent_shape`` (batch
        included) beyond the weights, on the path it is served (``tiled`` as the runner passes
        it): the 413 admission check and the runner's plan both read it. Every family
        overrides it from its own chunks, windows, tiles and clips, checked against a measured
        peak (tests/test_memory_estimate.py); this default (the output, 8 times over) is for
        test doubles only."""
        return 8 * self.output_values(latent_shape) * element_size

    def planned_bytes(
        self, latent_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        """What one ``decode`` (``tiled`` as the runner would pass it) on this copy's device is
        planned to hold beyond the weights (the 413 admission check, a micro-batch's rows):
        ``working_bytes`` times the device's margin; on the CPU ``cpu_margin`` plus one copy of
        the largest conv weight (oneDNN re-orders a conv's weight into a buffer of its own on
        every call), elsewhere (a GPU; the meta device, where the GPU proof plans an L4)
        ``gpu_margin``."""
        work = self.working_bytes(latent_shape, element_size, tiled)
        if next(self.parameters()).device.type != "cpu":
            return int(work * self.gpu_margin)
        return int(work * self.cpu_margin) + self.largest_conv_weight()

    def largest_conv_weight(self) -> int:
        """Bytes of this copy's largest convolution weight."""
        convs = (m.weight for m in self.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d)))
        return max((w.numel() * w.element_size() for w in convs), default=0)

    def output_values(self, latent_shape: tuple[int, ...]) -> int:
        """Values of ``decode``'s output for a latent of ``latent_shape``."""
        frames = self.frames_out(latent_shape[2]) if len(latent_shape) == 5 else 1
        pixels = latent_shape[-2] * latent_shape[-1] * self.spatial_scale**2
        return latent_shape[0] * 3 * frames * pixels

    def summary(self) -> dict[str, Any]:
        """Short description for ``GET /models``."""
        return {
            "latent_channels": self.latent_channels,
            "spatial_scale": self.spatial_scale,
            "temporal_scale": self.temporal_scale,
            "video": self.is_video,
            "output_space": self.output_space,
        }

    # --- decoding -------------------------------------------------------
    def denormalize(self, z: Tensor) -> Tensor:
        """The model's own latent de-normalization (``do_scaling`` without factors)."""
        return z

    @abstractmethod
    def decode(self, z: Tensor, **options: Any) -> Tensor:
        """Latent ``[B,C,H,W]`` (or ``[B,C,T,H,W]``) -> RGB in ``output_space``.

        Exactly what the reference implementation's ``.decode`` returns.
        ``options`` carries per-request knobs a family understands (for
        example ``timestep`` and ``seed`` for LTX); unknown ones are ignored.
        """

    def iter_decode(self, z: Tensor, **options: Any) -> Iterator[Tensor]:
        """``decode`` in frame chunks ``[B,3,t,H,W]``, in order (video decoders stream)."""
        yield self.decode(z, **options)

    def stages(self) -> list[tuple[str, nn.Module]]:
        """The named stage modules (``conv_in``, ``mid``, ``up_0``...) whose calls are timed;
        ``app.telemetry.timing.instrument`` hooks them, so model code carries no timer. A stage made of
        several consecutive modules lists each under its name (their times add up). The names
        are a metrics contract."""
        return []

    def keeps_float32(self, name: str) -> bool:
        """Whether parameter ``name`` stays float32 on a bf16/fp16 copy: the architecture
        computes it in float32 (as diffusers' ``_keep_in_fp32_modules``)."""
        return False

    def optimize(self) -> None:
        """Turn on this family's fast-path rewrites (on the served copy, behind the gate);
        by default the width-only Winograd opt-in of ``winograd_max_channels``."""
        if self.winograd_max_channels:
            winograd.prepare(self, max_channels=self.winograd_max_channels)

    def forward(self, z: Tensor) -> Tensor:
        """The exact architecture, one pass (families override it; ``decode`` adds the
        dtype/device handling, options and tiling policy)."""
        return self.decode(z)

    def to_unit(self, x: Tensor) -> Tensor:
        """Map ``decode``'s output to RGB in [0, 1], clamped."""
        if self.output_space == "signed":
            x = x / 2 + 0.5
        elif self.output_space == "imagenet":
            shape = (1, 3) + (1,) * (x.ndim - 2)
            mean = torch.tensor(IMAGENET_MEAN, dtype=x.dtype, device=x.device).view(shape)
            std = torch.tensor(IMAGENET_STD, dtype=x.dtype, device=x.device).view(shape)
            x = x * std + mean
        return x.clamp(0, 1)

    def probe_latent(self, generator: torch.Generator, tiled: bool = False) -> Tensor:
        """A seeded N(0,1) latent of a representative size, for the parity gate. With
        ``tiled`` (families that ``supports_tiling`` override it): larger than one tile of the
        geometry ``decode(tiled=True)`` uses, so a gate check of it really tiles."""
        cells = max(1, 256 // self.spatial_scale)
        shape = (1, self.latent_channels)
        if self.is_video:
            shape += (2,)
        return torch.randn(shape + (cells, cells), generator=generator)

    def full_latent(self, generator: torch.Generator) -> Tensor:
        """A seeded N(0,1) latent of the family's ``native_size`` (video: of
        ``native_latent_frames`` frames), laid out as ``probe_latent``'s."""
        shape = list(self.probe_latent(torch.Generator().manual_seed(0)).shape)
        height, width = self.native_size
        shape[-2:] = [height // self.spatial_scale, width // self.spatial_scale]
        if len(shape) == 5:
            shape[2] = self.native_latent_frames
        return torch.randn(shape, generator=generator)


def decode_chunks(decoder: VAEDecoder, z: Tensor, options: dict[str, Any]) -> Tensor:
    """A video decoder's ``iter_decode`` chunks as one video; a 4-D latent is one frame and
    decodes to a 4-D image."""
    image = z.ndim == 4
    chunks = list(decoder.iter_decode(z.unsqueeze(2) if image else z, **options))
    out = torch.cat(chunks, 2) if len(chunks) > 1 else chunks[0]
    return out[:, :, 0] if image else out
