"""The one interface every encoder family implements (pixels in, latents out).

An encoder family is a package ``app/encoders/<family>/`` following the decoders' template
(docs/decoders.md): ``model.py`` (the layers and the architecture's ``forward``; torch,
``app/decoders/ops`` and the decoder family's shared layers only), ``encode.py`` (the
family's ``Encoder``: clips, tiles, geometry, normalisation, its working-memory estimate),
``convert.py`` (checkpoint layouts -> canonical encoder-only names) and ``synthetic.py``
(seeded trained-like weights). The family keys are the decoders' (``FAMILIES``).

``Encoder.moments`` is exactly what the reference's ``encode(x).latent_dist`` holds: the
concatenated ``[mean, logvar]`` along channels for the KL families (diffusers'
``DiagonalGaussianDistribution.parameters``), or the latent itself for deterministic encoders
(TAESD). ``encode`` turns it into the latent a client receives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import Tensor, nn


class VAEEncoder(nn.Module, ABC):
    """A resident VAE encoder: RGB in [-1, 1] (``[B,3,H,W]`` or ``[B,3,T,H,W]``) -> latent."""

    family: ClassVar[str]
    is_video: ClassVar[bool] = False
    # False for encoders whose output is the latent itself (TAESD): no logvar half.
    gaussian: ClassVar[bool] = True

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
    def temporal_scale(self) -> int:
        return 1

    def latent_frames(self, frames: int) -> int:
        """Latent frames encoded from ``frames`` input frames (video encoders override)."""
        return frames

    @abstractmethod
    def moments(self, x: Tensor, **options: Any) -> Tensor:
        """Exactly the reference's ``encode(x).latent_dist.parameters`` (or its latent)."""

    def encode(
        self,
        x: Tensor,
        sample: bool = False,
        generator: torch.Generator | None = None,
        **options: Any,
    ) -> Tensor:
        """The latent: the distribution's mean, or a sample drawn with ``generator``."""
        m = self.moments(x, **options)
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

    def working_bytes(self, input_shape: tuple[int, ...], element_size: int) -> int:
        """Estimated device bytes of encoding an input of ``input_shape`` (batch included)."""
        pixels = input_shape[0] * input_shape[-2] * input_shape[-1]
        frames = input_shape[2] if len(input_shape) == 5 else 1
        return pixels * frames * 512 * element_size

    def probe_input(self, generator: torch.Generator) -> Tensor:
        """A seeded input in [-1, 1] of a representative size, for the parity gate."""
        side = max(self.spatial_scale * 4, 64)
        shape = (1, 3) + ((1 + self.temporal_scale,) if self.is_video else ()) + (side, side)
        return torch.rand(shape, generator=generator) * 2 - 1

    def optimize(self) -> None:
        """Turn on this family's fast-path rewrites (on the served copy, behind the gate)."""
