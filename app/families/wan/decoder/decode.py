"""The Wan family served: ``Decoder`` = ``model.Architecture`` behind ``VAEDecoder``.

``iter_decode`` streams ``chunk_frames`` latent frames at a time through ``forward`` (each tile
with its own ``FrameCache``); ``tiled=True`` runs diffusers' ``AutoencoderKLWan.tiled_decode``
tiles: the latent cut into tiles of ``tile_sample_size // compression`` cells every
``tile_sample_stride // compression`` cells, each decoded on its own, then blended in place in
raster order with the tile above / to the left (linear ramps over ``size - stride`` output
pixels), each keeping its top-left ``stride`` square. Blending is frame-local, so each chunk
blends the same way; Wan 2.2 tiles and blends in the patched (pre-unpatchify) space, as the
reference does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from app.families import ops
from app.families.decoder import VAEDecoder, decode_chunks
from app.families.tiling import DEFAULT_TILE_SAMPLE_SIZE, Grid, sample_grid
from app.families.wan.decoder import fast
from app.families.wan.decoder.model import Architecture, FrameCache, unpatchify
from app.telemetry.timing import phase

DEFAULT_CHUNK_FRAMES = 2  # latent frames per streamed chunk
# Latent frames per chunk by device type (issue 23.7): a GPU keeps 2 until the GPU proof's
# `video` section measures GPU_CHUNK_CANDIDATES on a card.
CHUNK_FRAMES = {"cpu": DEFAULT_CHUNK_FRAMES, "cuda": DEFAULT_CHUNK_FRAMES}
GPU_CHUNK_CANDIDATES = (2, 4, 8)


def chunk_frames_for(device: torch.device) -> int:
    """The served chunk length on ``device`` (a request's ``chunk_frames`` wins)."""
    return CHUNK_FRAMES.get(device.type, DEFAULT_CHUNK_FRAMES)


# Working memory of one chunk per pixel of one output frame, in values of the compute dtype
# per channel of the full-resolution stage (measured on the meta device with
# tests/test_memory_estimate.py): a chunk's full-resolution frames through a resnet (input,
# RMSNorm in float32, SiLU, the causal pad, the conv output). The conv caches are counted
# apart (``cache_values_per_cell``).
CHUNK_VALUES_PER_PIXEL_PER_CHANNEL = 58


class Decoder(Architecture, VAEDecoder):
    """Wan 2.1 / 2.2 / Qwen-Image decoder (``decode``: what ``AutoencoderKLWan.decode``, or
    ``AutoencoderKLQwenImage.decode``, returns)."""

    output_space = "signed"
    is_video = True
    gpu_margin = 1.1  # the H200 proof's peak over the estimate (docs/decoders.md)
    native_size = (480, 832)
    supports_tiling = True

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        z = config["z_dim"]
        mean, std = config.get("latents_mean"), config.get("latents_std")
        self.register_buffer("latents_mean", _stat(mean, z, 0.0), persistent=False)
        self.register_buffer("latents_std", _stat(std, z, 1.0), persistent=False)

    # --- geometry ---------------------------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return self.config["z_dim"]

    @property
    def spatial_scale(self) -> int:
        return 2**self.upsamples * self.patch

    @property
    def temporal_scale(self) -> int:
        return 2**self.temporal_ups

    def frames_out(self, latent_frames: int) -> int:
        return 1 + self.temporal_scale * (latent_frames - 1)

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "variant": self.config.get("variant", "wan")}

    def working_bytes(
        self, latent_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        """The decoded chunks and their concatenation (``decode_chunks``), every tile's
        ``FrameCache`` (all tiles stream side by side), and one chunk's working set through
        the full-resolution stage (of one tile when ``tiled``)."""
        b, h, w = latent_shape[0], latent_shape[-2], latent_shape[-1]
        cells = h * w  # of every tile's cache together
        if tiled:
            grid = self._grid(torch.empty(latent_shape, device="meta"), {})
            if grid is not None:
                cells = sum(len(range(h)[ys]) * len(range(w)[xs]) for ys, xs in grid.tiles)
                tile = DEFAULT_TILE_SAMPLE_SIZE // self._compression()
                h, w = min(h, tile), min(w, tile)
        width = self.config["decoder_base_dim"] * self.config["dim_mult"][0]
        pixels = h * w * 4**self.upsamples  # of the last stage (before Wan 2.2's unpatchify)
        chunk = pixels * width * CHUNK_VALUES_PER_PIXEL_PER_CHANNEL
        caches = cells * self.cache_values_per_cell()
        return int((2 * self.output_values(latent_shape) + b * (chunk + caches)) * element_size)

    def cache_values_per_cell(self) -> int:
        """Values of every temporal conv's carried frames (``FrameCache``) per latent cell."""
        total, area = 0, 1

        def carried(conv: nn.Conv3d | None) -> int:
            return 0 if conv is None else (conv.kernel_size[0] - 1) * conv.in_channels * area

        total += carried(self.conv_in)
        for block in [self.mid_block, *self.up_blocks]:
            for resnet in block.resnets:
                total += carried(resnet.conv1) + carried(resnet.conv2)
            upsampler = getattr(block, "upsampler", None)
            if upsampler is None and getattr(block, "upsamplers", None) is not None:
                upsampler = block.upsamplers[0]
            if upsampler is not None:
                total += carried(upsampler.time_conv)
                area *= 4
        return total + carried(self.conv_out)

    def probe_latent(self, generator: torch.Generator, tiled: bool = False) -> Tensor:
        if not tiled:
            return super().probe_latent(generator)
        cells = DEFAULT_TILE_SAMPLE_SIZE // self._compression() + 2  # two tiles per side
        return torch.randn((1, self.latent_channels, 2, cells, cells), generator=generator)

    def optimize(self) -> None:
        fast.optimize(self)

    def stages(self) -> list[tuple[str, nn.Module]]:
        ups = [(f"up_{i}", block) for i, block in enumerate(self.up_blocks)]
        return [
            ("conv_in", self.conv_in),
            ("mid", self.mid_block),
            *ups,
            ("conv_out", self.conv_out),
        ]

    def denormalize(self, z: Tensor) -> Tensor:
        """``z * std + mean`` per channel (what Wan and Qwen-Image pipelines apply)."""
        shape = (1, -1) + (1,) * (z.ndim - 2)
        std, mean = self.latents_std.to(z).view(shape), self.latents_mean.to(z).view(shape)
        return z * std + mean

    # --- decoding ---------------------------------------------------------------------------
    def decode(self, z: Tensor, **options: Any) -> Tensor:
        """A 4-D latent is one frame and decodes to a 4-D image."""
        return decode_chunks(self, z, options)

    def iter_decode(self, z: Tensor, **options: Any) -> Iterator[Tensor]:
        """Output frames ``[B,3,t,H,W]`` in order, ``chunk_frames`` latent frames at a time.

        Options: ``chunk_frames`` (default 2; 0 = the whole clip at once); ``tiled`` (None or
        False: one pass, as diffusers decodes by default; True: diffusers' ``tiled_decode``
        tiles and blend, when the latent is larger than one tile); ``tile_sample_size`` /
        ``tile_sample_stride`` (pixels, diffusers' 256 / 192)."""
        if z.ndim == 4:
            z = z.unsqueeze(2)
        z = ops.to_model(z, self.conv_in.weight)
        chunk = options.get("chunk_frames", chunk_frames_for(z.device))
        step = int(chunk) or z.shape[2]
        grid = self._grid(z, options) if options.get("tiled") else None
        caches = [FrameCache() for _ in (grid.tiles if grid else [None])]
        for t0 in range(0, z.shape[2], step):
            part = z[:, :, t0 : t0 + step]
            if grid is None:
                out = self(part, caches[0])
            else:
                outs = [self(part[..., ys, xs], cache) for (ys, xs), cache in
                        zip(grid.tiles, caches, strict=True)]  # fmt: skip
                with phase("blend"):
                    out = grid.blend(outs)
            out = unpatchify(out, self.patch)
            # AutoencoderKLQwenImage.tiled_decode returns its blend unclamped ("tiled_clamp")
            clamp = grid is None or self.config.get("tiled_clamp", True)
            yield out.clamp(-1.0, 1.0) if clamp else out

    def _compression(self) -> int:
        return int(self.config.get("spatial_compression_ratio") or self.spatial_scale)

    def _grid(self, z: Tensor, options: dict[str, Any]) -> Grid | None:
        """The reference's tiles for latent ``z``; None when it fits in one tile."""
        return sample_grid(z, options, self._compression(), self.patch)


def _stat(values: list[float] | None, channels: int, default: float) -> Tensor:
    if values is None:
        return torch.full((channels,), default)
    return torch.tensor(values, dtype=torch.float32)
