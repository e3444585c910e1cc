"""The HunyuanVideo family served: ``Decoder`` = ``model.Architecture`` behind ``VAEDecoder``.

``iter_decode`` runs the reference's frame windows (``tiling.windows``) and, with
``tiled=True``, its spatial tiles (``tiling.grid``) over ``forward``, blending as it goes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from app.families.decoder import VAEDecoder, decode_chunks
from app.families.hunyuan_video.decoder import fast, tiling
from app.families.hunyuan_video.decoder.model import Architecture
from app.families.tiling import DEFAULT_TILE_SAMPLE_SIZE, Grid, blend_edge
from app.telemetry.timing import phase

# Working memory of one window pass per pixel of its output frames, in values of the compute
# dtype per channel of the full-resolution stage (measured on the meta device with
# tests/test_memory_estimate.py): GroupNorm over the whole window, the replicate-padded copy
# and the conv output of the 256-channel upsampler and the resnets after it.
WINDOW_VALUES_PER_PIXEL_PER_CHANNEL = 8.8


class Decoder(Architecture, VAEDecoder):
    """HunyuanVideo's VAE decoder (``decode``: what ``AutoencoderKLHunyuanVideo.decode``
    returns, frame windows by default)."""

    output_space = "signed"
    is_video = True
    native_size = (720, 1280)
    supports_tiling = True
    cpu_margin = 1.6  # each padded conv input's copy in oneDNN's layout (docs/decoders.md)
    gpu_margin = 1.4  # the H200 proof's peak over the estimate (docs/decoders.md)
    winograd_max_channels = 256  # CPU fast path: the 512-channel convs keep direct kernels

    # --- geometry ---------------------------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return self.config["latent_channels"]

    @property
    def spatial_scale(self) -> int:
        return self._spatial

    @property
    def temporal_scale(self) -> int:
        return self._temporal

    def frames_out(self, latent_frames: int) -> int:
        return 1 + self.temporal_scale * (latent_frames - 1)

    def working_bytes(
        self, latent_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        """The decoded windows and their concatenation (``decode_chunks``), plus one window
        pass (of one tile when ``tiled``)."""
        b, h, w = latent_shape[0], latent_shape[-2], latent_shape[-1]
        if tiled:
            cells = DEFAULT_TILE_SAMPLE_SIZE // self.spatial_scale
            h, w = min(h, cells), min(w, cells)
        frames = latent_shape[2] if len(latent_shape) == 5 else 1
        window = tiling.DEFAULT_WINDOW_FRAMES // self.temporal_scale + 1
        values = self.frames_out(min(frames, window)) * h * w * self.spatial_scale**2
        width = self.config["block_out_channels"][0]
        per_window = b * values * width * WINDOW_VALUES_PER_PIXEL_PER_CHANNEL
        return int((2 * self.output_values(latent_shape) + per_window) * element_size)

    def stages(self) -> list[tuple[str, nn.Module]]:
        ups = [(f"up_{i}", block) for i, block in enumerate(self.up_blocks)]
        return [
            ("conv_in", self.post_quant_conv),
            ("conv_in", self.conv_in),
            ("mid", self.mid_block),
            *ups,
            ("conv_out", self.conv_norm_out),
            ("conv_out", self.conv_act),
            ("conv_out", self.conv_out),
        ]

    def probe_latent(self, generator: torch.Generator, tiled: bool = False) -> Tensor:
        # two latent frames (5 output frames) of 8x8 cells exercise every layer, the causal
        # attention across frames included; CPUs without bf16 kernels run 3-D convs slowly.
        # Tiled: two default tiles per side.
        cells = DEFAULT_TILE_SAMPLE_SIZE // self.spatial_scale + 2 if tiled else 8
        return torch.randn((1, self.latent_channels, 2, cells, cells), generator=generator)

    def denormalize(self, z: Tensor) -> Tensor:
        """``z / scaling_factor`` (what HunyuanVideoPipeline applies before decoding)."""
        return z / self.config["scaling_factor"]

    # --- decoding ---------------------------------------------------------------------------
    def decode(self, z: Tensor, **options: Any) -> Tensor:
        """Frame windows by default; a 4-D latent is one frame and decodes to a 4-D image."""
        return decode_chunks(self, z, options)

    def iter_decode(self, z: Tensor, **options: Any) -> Iterator[Tensor]:
        """Output frames ``[B,3,t,H,W]`` in order, one frame window at a time.

        Options (diffusers' names in brackets):
          ``windowed`` (default True [use_framewise_decoding]): overlapping windows of
            ``window_frames // 4 + 1`` latent frames every ``window_stride // 4``, when the
            clip has more than ``window_frames // 4`` latent frames; False: one pass;
          ``window_frames`` / ``window_stride`` (output frames, 16 / 12
            [tile_sample_min_num_frames / tile_sample_stride_num_frames]);
          ``tiled`` (None or False: no spatial tiles, diffusers' default; True: its
            ``tiled_decode`` when the latent exceeds one tile [enable_tiling]);
          ``tile_sample_size`` / ``tile_sample_stride`` (pixels, 256 / 192)."""
        if z.ndim == 4:
            z = z.unsqueeze(2)
        weight = self.conv_in.conv.weight
        z = z.to(device=weight.device, dtype=weight.dtype)
        grid = tiling.grid(self, z, options) if options.get("tiled") else None
        plan = tiling.windows(self, z.shape[2], options)
        tail = None
        for window in plan.windows:
            out = self._decode_window(z[:, :, window.latent], grid)
            if window.drop_first:
                out = out[:, :, 1:]
            if tail is not None:
                with phase("blend"):
                    blend_edge(tail, out, plan.blend, dim=2)
            tail = out[:, :, max(0, out.shape[2] - plan.blend) :]
            yield out[:, :, : window.keep]

    def optimize(self) -> None:
        fast.optimize(self, self.winograd_max_channels)

    def _decode_window(self, z: Tensor, grid: Grid | None) -> Tensor:
        """One pass over a window of latent frames, in spatial tiles where ``grid`` says."""
        if grid is None:
            return self(z)
        outs = [self(z[..., ys, xs]) for ys, xs in grid.tiles]
        with phase("blend"):
            return grid.blend(outs)
