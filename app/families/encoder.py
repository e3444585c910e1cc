"""The one interface every encoder family implements (pixels in, latents out).

An encoder is the ``encoder/`` sub-package of its family's package
(``app/families/<package>/encoder/``, docs/encoders.md), described by the family's ``FAMILY``
descriptor: ``model.py`` (the layers and the architecture's ``forward``), ``encode.py`` (the
family's ``Encoder``: clips, tiles, geometry, normalisation, its working-memory estimate),
``convert.py`` (checkpoint layouts -> canonical encoder-only names) and ``synthetic.py``
(seeded trained-like weights).

``Encoder.moments`` is exactly what the reference's ``encode(x).latent_dist`` holds: the
concatenated ``[mean, logvar]`` along channels for the KL families (diffusers'
``DiagonalGaussianDistribution.parameters``), or the latent itself for deterministic encoders
(TAESD). ``encode`` turns it into the latent a client receives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn


class Clip(Protocol):
    """Video frames an encoder reads window by window, ``[B,3,T,H,W]`` in [-1, 1] on the CPU,
    without the whole clip in memory (an MP4 body is decoded as the encoder asks for frames:
    ``app.media.read.Mp4Clip``); a tensor is one too (``TensorClip``)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def window(self, start: int, stop: int) -> Tensor:
        """Frames ``[start, stop)`` (fewer at the end of the clip)."""
        ...

    def release(self, before: int) -> None:
        """Frames before ``before`` will not be asked for again."""
        ...

    def close(self) -> None: ...


class VAEEncoder(nn.Module, ABC):
    """A resident VAE encoder: RGB in [-1, 1] (``[B,3,H,W]`` or ``[B,3,T,H,W]``) -> latent."""

    family: ClassVar[str]  # the family key: set by its descriptor (app/families/descriptor.py)
    is_video: ClassVar[bool] = False
    # False for encoders whose output is the latent itself (TAESD): no logvar half.
    gaussian: ClassVar[bool] = True
    # a served copy on the CPU lays its conv weights channels-last (modes.set_channels_last)
    channels_last: ClassVar[bool] = False
    # ``moments`` / ``iter_moments`` take ``tiled=True`` (the reference's spatial tiles), and
    # ``working_bytes(..., tiled=True)`` plans it: the runner tiles an input whose untiled plan
    # exceeds what one request may plan (``VAE_MAX_DECODE_MB``), as for decoders
    supports_tiling: ClassVar[bool] = False

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)

    @property
    @abstractmethod
    def latent_channels(self) -> int:
        """Channels of the latent (the mean), not of the moments."""

    @property
    @abstractmethod
    def spatial_scale(self) -> int:
        """Pixels per latent cell along H and W."""

    @property
    def min_cells(self) -> int:
        """The fewest latent cells along H and W an encode makes: 2 where a conv pads the
        deepest map by reflection (one cell has nothing to reflect; the reference fails)."""
        return 1

    @property
    def temporal_scale(self) -> int:
        return 1

    def latent_frames(self, frames: int) -> int:
        """Latent frames encoded from ``frames`` input frames (video encoders override)."""
        return frames

    @abstractmethod
    def moments(self, x: Tensor, **options: Any) -> Tensor:
        """Exactly the reference's ``encode(x).latent_dist.parameters`` (or its latent)."""

    def iter_moments(self, x: Tensor | Clip, **options: Any) -> Iterator[Tensor]:
        """``moments`` in latent-frame chunks, in order, concatenated along dim 2 they are
        ``moments(x)``. A video encoder overrides it to read its clip window by window (the
        worker serves other work between chunks, and an MP4 is never whole in memory); by
        default one chunk of the whole input."""
        if not isinstance(x, Tensor):
            x = x.window(0, x.shape[2])
        yield self.moments(x, **options)

    def encode(
        self,
        x: Tensor,
        sample: bool = False,
        generator: torch.Generator | None = None,
        **options: Any,
    ) -> Tensor:
        """The latent: the distribution's mean, or a sample drawn with ``generator``."""
        return self.latent(self.moments(x, **options), sample, generator)

    def latent(
        self, m: Tensor, sample: bool = False, generator: torch.Generator | None = None
    ) -> Tensor:
        """The latent of moments ``m``: the mean, or a sample drawn with ``generator`` (the
        noise on the CPU, so a seed gives the same sample on every device)."""
        if not self.gaussian:
            return m
        mean, logvar = m.chunk(2, dim=1)
        if not sample:
            return mean
        std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
        noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device="cpu")
        return mean + std * noise.to(mean.device)

    def normalize(self, z: Tensor) -> Tensor:
        """The model's own latent normalisation (``do_scaling`` without factors): the inverse
        of the decoder's ``denormalize``."""
        return z

    def stages(self) -> list[tuple[str, nn.Module]]:
        """Named stage modules (``conv_in``, ``down_0``..., ``mid``, ``conv_out``) for timing."""
        return []

    def working_bytes(
        self, input_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        """Estimated device bytes of encoding an input of ``input_shape`` (batch included);
        ``tiled`` only where the family ``supports_tiling``."""
        pixels = input_shape[0] * input_shape[-2] * input_shape[-1]
        frames = input_shape[2] if len(input_shape) == 5 else 1
        return pixels * frames * 512 * element_size

    def planned_bytes(
        self, input_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        """What one ``moments`` (``tiled`` as the runner would pass it) is planned to hold
        beyond the weights (the 413 admission check and a micro-batch's rows):
        ``working_bytes``, which each family measures on the CPU already
        (tests/test_encoder_memory.py), so no margin as the decoders' has."""
        return self.working_bytes(input_shape, element_size, tiled)

    def probe_input(self, generator: torch.Generator) -> Tensor:
        """A seeded input in [-1, 1] of a representative size, for the parity gate."""
        side = max(self.spatial_scale * 4, 64)
        shape = (1, 3) + ((1 + self.temporal_scale,) if self.is_video else ()) + (side, side)
        return torch.rand(shape, generator=generator) * 2 - 1

    def frames_problem(self, frames: int) -> str:
        """Why a clip of ``frames`` frames cannot be encoded ("": it can): a family whose
        reference refuses some counts says so in words, with its rule."""
        return ""

    def keeps_float32(self, name: str) -> bool:
        """Whether parameter ``name`` stays float32 on a bf16/fp16 copy (as the decoders')."""
        return False

    def optimize(self) -> None:
        """Turn on this family's fast-path rewrites (on the served copy, behind the gate)."""


class TensorClip:
    """A clip already in memory, ``[B,3,T,H,W]``: its windows are slices."""

    def __init__(self, x: Tensor) -> None:
        self.x = x

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape)

    def window(self, start: int, stop: int) -> Tensor:
        return self.x[:, :, start:stop]

    def release(self, before: int) -> None:
        pass

    def close(self) -> None:
        pass
