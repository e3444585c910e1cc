"""The FLUX family served: ``Decoder`` = ``model.Architecture`` behind ``VAEDecoder``.

Geometry, the latent de-normalization (FLUX.2's BatchNorm statistics), the row-band policy
(``tiled``), the stages the registry times and the family's working-memory estimate.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from app.families import ops
from app.families.decoder import VAEDecoder
from app.families.flux.decoder import fast
from app.families.flux.decoder.model import Architecture

# Row bands save memory but cost a statistics pass per GroupNorm (docs/BENCHMARKS.md), so by
# default (tiled=None, optimized copy) they are used only where memory matters: 1 Mpixel up.
BAND_MIN_PIXELS = 1024 * 1024
# Working memory per output pixel, in values of the compute dtype (measured on the meta
# device with tests/test_memory_estimate.py): the full-resolution up block holds about six
# 128-channel maps at once; row bands hold the block's input and one activation.
UNTILED_VALUES_PER_PIXEL = 800
BANDED_VALUES_PER_PIXEL = 460
# Bytes of float32 temporaries per row band by device type (issue 23.7: the out-of-memory
# retry's band): a GPU keeps 32 MiB until the GPU proof measures GPU_BAND_BYTES_CANDIDATES.
BAND_BYTES = {"cpu": fast.ROW_BAND_BYTES, "cuda": fast.ROW_BAND_BYTES}
GPU_BAND_BYTES_CANDIDATES = (32 << 20, 128 << 20, 512 << 20)


def band_bytes_for(device: torch.device, config: dict[str, Any] | None = None) -> int:
    """An entry's own ``band_mb`` (its config) where it sets one, else the device's band."""
    if config and config.get("band_mb"):
        return int(config["band_mb"] * 2**20)
    return BAND_BYTES.get(device.type, fast.ROW_BAND_BYTES)


class Decoder(Architecture, VAEDecoder):
    output_space = "signed"
    channels_last = True
    cpu_margin = 1.35  # the exact (NCHW) decoder's oneDNN copies (docs/decoders.md)
    gpu_margin = 1.35  # the H200 proof's peak over the estimate (docs/decoders.md)
    supports_tiling = True  # row bands (fast.decode_banded): exact, less memory
    exact_tiling = True

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        # Row bands by default (tiled=None) only once ``optimize`` turns them on, and only for
        # outputs of at least band_min_pixels; band_bytes sizes a band whenever bands run.
        self.bands_by_default = False
        self.band_bytes = band_bytes_for(torch.device("cpu"), self.config)
        self.band_min_pixels = BAND_MIN_PIXELS

    # --- geometry -------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return self.config["latent_channels"]

    @property
    def spatial_scale(self) -> int:
        return 2 ** (len(self.config["block_out_channels"]) - 1)

    def working_bytes(
        self, latent_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        pixels = latent_shape[0] * latent_shape[-2] * latent_shape[-1] * self.spatial_scale**2
        per_pixel = BANDED_VALUES_PER_PIXEL if tiled else UNTILED_VALUES_PER_PIXEL
        width = list(self.config["block_out_channels"])[0] / 128  # the full-resolution width
        return int(pixels * per_pixel * width * element_size)

    # --- decoding -------------------------------------------------------
    def denormalize(self, z: Tensor) -> Tensor:
        """FLUX.2: BatchNorm stats over the 2x2 patch layout; others: z / scale + shift."""
        if self.bn is None:
            return z / self.config["scaling_factor"] + (self.config.get("shift_factor") or 0.0)
        std = torch.sqrt(self.bn.running_var + self.config.get("batch_norm_eps", 1e-4))
        std, mean = std.view(1, -1, 1, 1).to(z), self.bn.running_mean.view(1, -1, 1, 1).to(z)
        return ops.unpatchify2x2(ops.patchify2x2(z) * std + mean)

    def decode(self, z: Tensor, tiled: bool | None = None, **options: Any) -> Tensor:
        """``tiled``: None = row bands on an optimized copy for large outputs, True = always
        row bands (the out-of-memory retry), False = never."""
        z = ops.to_model(z, self.conv_in.weight)
        if tiled is None:
            pixels = z.shape[0] * z.shape[-2] * z.shape[-1] * self.spatial_scale**2
            tiled = self.bands_by_default and pixels >= self.band_min_pixels
        if tiled:
            return fast.decode_banded(self, z, self.band_bytes)
        return self(z)

    def probe_latent(self, generator: torch.Generator, tiled: bool = False) -> Tensor:
        """Tiled: large enough that the full-resolution layers take two or more row bands
        of ``band_bytes`` (float32 temporaries of a band)."""
        if not tiled:
            return super().probe_latent(generator)
        width = list(self.config["block_out_channels"])[0]
        side = math.isqrt(self.band_bytes // (4 * width))  # pixels of one band's square
        cells = max(side // self.spatial_scale + 2, 256 // self.spatial_scale)
        return torch.randn((1, self.latent_channels, cells, cells), generator=generator)

    def stages(self) -> list[tuple[str, nn.Module]]:
        conv_in = [m for m in (self.post_quant_conv, self.conv_in) if m is not None]
        return [
            *(("conv_in", m) for m in conv_in),
            ("mid", self.mid_block),
            *((f"up_{i}", block) for i, block in enumerate(self.up_blocks)),
            *(("conv_out", m) for m in (self.conv_norm_out, self.conv_act, self.conv_out)),
        ]

    def optimize(self) -> None:
        fast.optimize(self)
        self.band_bytes = band_bytes_for(self.conv_in.weight.device, self.config)
        self.bands_by_default = True
