"""The LTX family served: ``Decoder`` = ``model.Architecture`` behind ``VAEDecoder``.

One class for LTX-Video 0.9.x and LTX-2: a config with ``"version": "ltx2"`` builds its
network from ``ltx2.ltx2_spec`` (LTX-2's defaults filled in), any other from
``model.decoder_spec``. ``iter_decode`` draws the decode's conditioning once, then streams
the clip in frame chunks (and, ``tiled``, blended spatial tiles) through ``streaming.py``.

Options of ``decode`` / ``iter_decode`` (unknown ones are ignored):
  timestep (float or per-batch list): timestep-conditioned models only; default
      ``config["decode_timestep"]``, else 0.0 (LTXPipeline's ``decode_timestep`` default).
  seed (int): noise injection; default ``config["seed"]``, else 0 (deterministic, so the
      parity gate and batching see repeatable output). Nothing is drawn without noise layers.
  chunk_frames (int): latent frames per temporal chunk (default 2; 0 = whole clip at once).
  tiled (bool): spatial tiles (None/False: none, the default), tile_size / tile_overlap
      (latent cells, default 16 / 4).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from app.families.decoder import VAEDecoder
from app.families.ltx.decoder import ltx2, streaming
from app.families.ltx.decoder.model import DEFAULT_FPS, Architecture
from app.families.ops import fewest_cells
from app.telemetry import timing

DEFAULT_CHUNK_FRAMES = 2  # latent frames per streamed chunk
# Latent frames per chunk by device type (issue 23.7): 2 keeps a CPU chunk in cache; on a GPU
# 4, where the H200 proof's `video` section measured the knee of GPU_CHUNK_CANDIDATES (time
# against peak memory: docs/gpu/README.md).
CHUNK_FRAMES = {"cpu": DEFAULT_CHUNK_FRAMES, "cuda": 4}
GPU_CHUNK_CANDIDATES = (2, 4, 8)


def chunk_frames_for(device: torch.device) -> int:
    """The served chunk length on ``device`` (a request's or config's ``chunk_frames`` wins)."""
    return CHUNK_FRAMES.get(device.type, DEFAULT_CHUNK_FRAMES)


DEFAULT_TILE_CELLS, DEFAULT_TILE_OVERLAP = 16, 4  # latent cells (``tiled=True``)
# Working memory of one chunk per pixel of the last block's resolution and output frame of
# the chunk, in values of the compute dtype per channel of that block (measured on the meta
# device with tests/test_memory_estimate.py): a resnet's input, RMSNorm's float32
# statistics and output, SiLU, the edge-padded copy and the conv output, and the skip FIFO.
CHUNK_VALUES_PER_PIXEL_PER_CHANNEL = 13.3


class Decoder(Architecture, VAEDecoder):
    """LTX-Video / LTX-2 decoder; ``decode`` equals ``AutoencoderKLLTXVideo.decode(z).sample``
    (``AutoencoderKLLTX2Video``'s for an LTX-2 config)."""

    output_space = "signed"
    is_video = True
    native_size = (512, 768)  # LTX-Video 0.9.x (LTX-2 renders larger)
    supports_tiling = True  # blended spatial tiles: approximate, never on by default
    cpu_margin = 1.4  # the resident set's growth in bf16 at full width (docs/decoders.md)
    gpu_margin = 1.35  # the H200 proof's peak over the estimate (docs/decoders.md)
    winograd_max_channels = 256  # CPU fast path: the 512/1024-channel convs stay direct

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(*ltx2.variant_spec(config))
        c = self.spec.latent_channels
        mean = torch.tensor(self.config.get("latents_mean") or [0.0] * c, dtype=torch.float32)
        std = torch.tensor(self.config.get("latents_std") or [1.0] * c, dtype=torch.float32)
        self.register_buffer("latents_mean", mean, persistent=False)
        self.register_buffer("latents_std", std, persistent=False)

    @property
    def version(self) -> str:
        """``"ltx2"`` for LTX-2, ``"0.9"`` for LTX-Video 0.9.x."""
        return ltx2.VERSION if isinstance(self.spec, ltx2.LTX2Spec) else "0.9"

    # --- geometry ------------------------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return self.spec.latent_channels

    def _upscale(self, axis: int) -> int:
        """The upsamplers' product along ``axis`` (0: time, 1: height)."""
        return math.prod(b.stride[axis] for b in self.spec.blocks if b.upsample)

    @property
    def spatial_scale(self) -> int:
        return self.spec.patch * self._upscale(1)

    @property
    def min_cells(self) -> int:
        return fewest_cells(getattr(self.spec, "padding_mode", "zeros"))  # LTX-2's spec has one

    @property
    def temporal_scale(self) -> int:
        return self.spec.patch_t * self._upscale(0)

    def frames_out(self, latent_frames: int) -> int:
        return ((latent_frames - 1) * self._upscale(0) + 1) * self.spec.patch_t

    def working_bytes(
        self, latent_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        """The assembled output (``decode`` preallocates it), plus one chunk through the
        last block (of one tile when ``tiled``, plus the chunk's blend buffers)."""
        b, h, w = latent_shape[0], latent_shape[-2], latent_shape[-1]
        frames = latent_shape[2] if len(latent_shape) == 5 else 1
        chunk = chunk_frames_for(next(self.parameters()).device)
        chunk_frames = min(frames, chunk) * self.temporal_scale
        out = self.output_values(latent_shape)
        blend = 0
        if tiled:
            blend = 3 * b * 3 * chunk_frames * h * w * self.spatial_scale**2
            h, w = min(h, DEFAULT_TILE_CELLS), min(w, DEFAULT_TILE_CELLS)
        last = self.spec.blocks[-1].cout if self.spec.blocks else self.spec.mid_channels
        pixels = h * w * (self.spatial_scale // self.spec.patch) ** 2
        chunk = b * chunk_frames * pixels * last * CHUNK_VALUES_PER_PIXEL_PER_CHANNEL
        return int((out + blend + chunk) * element_size)

    def summary(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if isinstance(self.spec, ltx2.LTX2Spec):
            extra = {"version": ltx2.VERSION, "padding_mode": self.spec.padding_mode}
        return {
            **super().summary(),
            "timestep_conditioning": self.spec.timestep,
            "inject_noise": self._noisy(),
            "causal": self.spec.causal,
            **extra,
            "fps": self.config.get("fps", DEFAULT_FPS),
        }

    def probe_latent(self, generator: torch.Generator, tiled: bool = False) -> Tensor:
        # tiled: two default tiles per side
        cells = DEFAULT_TILE_CELLS + DEFAULT_TILE_OVERLAP if tiled else 4
        return torch.randn((1, self.latent_channels, 2, cells, cells), generator=generator)

    def denormalize(self, z: Tensor) -> Tensor:
        """LTXPipeline._denormalize_latents: z * std / scaling_factor + mean, per channel
        (``LTX2Pipeline``'s is the same formula)."""
        shape = (1, -1) + (1,) * (z.ndim - 2)
        mean = self.latents_mean.to(z.device, z.dtype).view(shape)
        std = self.latents_std.to(z.device, z.dtype).view(shape)
        return z * std / float(self.config["scaling_factor"]) + mean

    def stages(self) -> list[tuple[str, nn.Module]]:
        head = (self.norm_out, self.conv_act, self.conv_out, self.unpatchify)
        return [
            ("conv_in", self.conv_in),
            ("mid", self.mid_block),
            *((f"up_{i}", block) for i, block in enumerate(self.up_blocks)),
            *(("conv_out", m) for m in head),
        ]

    # --- decoding ------------------------------------------------------------------------
    def decode(self, z: Tensor, **options: Any) -> Tensor:
        """``[B,C,T,H,W]`` -> ``[B,3,T',H',W']``; an image latent ``[B,C,H,W]`` is decoded as
        one frame and returned as ``[B,3,H',W']``."""
        if z.ndim == 4:
            return self.decode(z.unsqueeze(2), **options)[:, :, 0]
        total = self.frames_out(z.shape[2])
        out, pos = None, 0
        for piece in self.iter_decode(z, **options):
            if out is None and piece.shape[2] == total:  # one pass: nothing to assemble
                return piece
            if out is None:  # preallocate: no second full copy of the video
                out = piece.new_empty(piece.shape[:2] + (total,) + piece.shape[3:])
            out[:, :, pos : pos + piece.shape[2]] = piece
            pos += piece.shape[2]
        assert out is not None and pos == total, (pos, total)
        return out

    @torch.no_grad()
    def iter_decode(self, z: Tensor, **options: Any) -> Iterator[Tensor]:
        """Yield the decoded video in order as ``[B, 3, t, H, W]`` chunks (memory bounded)."""
        weight = self.conv_in.conv.weight
        z = z.to(device=weight.device, dtype=weight.dtype)
        if z.ndim == 4:
            z = z.unsqueeze(2)
        chunk = self.option(options, "chunk_frames", chunk_frames_for(weight.device))
        options = {**options, "chunk_frames": chunk}
        with timing.phase("condition"):
            cond = self.conditioning(z, options)
        yield from streaming.stream(self, z, cond, options, self.spatial_scale)
