"""Zero-cost previews: ComfyUI's latent-to-RGB approximation, no decoder.

A sampler shows progress each step by mapping every latent pixel's channels to RGB with a
published per-format linear map plus bias (app/media/preview_factors.py), then ``[-1, 1]`` to
``0..255`` as ComfyUI's ``preview_to_image`` does. The latent is the sampler's (the model's
scaled space, before ``do_scaling``'s de-normalization): nothing here de-normalizes it. One
small matmul: milliseconds on any CPU, at latent resolution (``scale`` repeats pixels to
enlarge it). Which factors a served model's latents take is the family's choice
(``app/http/preview.py``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from app.media.preview_factors import FACTORS

FORMATS = tuple(FACTORS)  # "sd1.5", "sdxl", "sd3", "flux1", "flux2", "ltxv", "wan2.1", ...


def _linear_map(key: str, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    if key not in FACTORS:
        raise ValueError(f"no published preview factors for {key!r}; known: {', '.join(FORMATS)}")
    factors, bias = FACTORS[key]
    weight = torch.tensor(factors, dtype=dtype)  # [C, 3]
    return weight, None if bias is None else torch.tensor(bias, dtype=dtype)


def preview(
    family_key: str, latent: Tensor | np.ndarray, *, frame: int | None = 0, scale: int = 1
) -> np.ndarray:
    """Latent ``[N, C, H, W]`` (or video ``[N, C, T, H, W]``) -> uint8 RGB ``[N, H, W, 3]``.

    ``family_key``: a latent format of ``FORMATS``. For a video latent ``frame`` picks one
    latent frame (ComfyUI previews the first); ``frame=None`` keeps them all, ``[N, T, H, W,
    3]``. ``scale`` > 1 repeats each pixel ``scale`` x ``scale`` times (nearest upscale).
    """
    z = torch.as_tensor(latent)
    if z.ndim not in (4, 5):
        raise ValueError(f"expected a latent [N, C, H, W] or [N, C, T, H, W], got {list(z.shape)}")
    if not z.is_floating_point():
        raise ValueError(f"expected a floating-point latent, got {z.dtype}")
    z = z.detach().to("cpu", torch.float32)
    weight, bias = _linear_map(family_key, torch.float32)
    if z.shape[1] != weight.shape[0]:
        raise ValueError(f"{family_key} latents have {weight.shape[0]} channels, got {z.shape[1]}")
    if z.ndim == 5 and frame is not None:
        if not -z.shape[2] <= frame < z.shape[2]:
            raise ValueError(f"frame {frame} is out of range for {z.shape[2]} latent frames")
        z = z[:, :, frame]
    n, c, *spatial = z.shape
    rgb = weight.T @ z.reshape(n, c, -1)  # [N, 3, pixels]: one small matmul
    if bias is not None:
        rgb += bias[:, None]
    pixels = rgb.clamp_(-1.0, 1.0).add_(1.0).mul_(127.5).round_().to(torch.uint8)
    pixels = pixels.permute(0, 2, 1).reshape(n, *spatial, 3)
    if scale > 1:
        pixels = pixels.repeat_interleave(scale, dim=-3).repeat_interleave(scale, dim=-2)
    return pixels.numpy()
