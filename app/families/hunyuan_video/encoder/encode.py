"""The HunyuanVideo encoder family: ``Encoder`` over ``model.EncoderNet``, with the
reference's temporal windows and spatial tiles.

Options of ``moments`` / ``encode`` (unknown ones are ignored):
  framewise (bool, default True, as the reference): a clip longer than
      ``tile_sample_frames`` (16) frames is encoded in windows of that many + 1 frames every
      ``tile_sample_frame_stride`` (12) frames; each window but the first drops its first
      latent frame and is blended over the overlap's latent frames into the one before.
  tiled (bool): diffusers' spatial tiles (``enable_tiling``), ``tile_sample_size`` /
      ``tile_sample_stride`` pixels (default 256 / 192); only where the frame is larger
      than one tile (inside each window when both apply).
``iter_moments`` yields each window's kept latent frames once they are final (a clip in one
window: one chunk); ``moments`` is their concatenation.
Frames: any count, as the reference; ``1 + 4k`` frames give ``1 + k`` latent frames (``T``
frames: ``(T - 1) // 4 + 1``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from app.families import encoding
from app.families.encoder import Clip, VAEEncoder
from app.families.encoder_memory import Level, peak_values
from app.families.hunyuan_video.encoder.model import EncoderNet, EncoderSpec, down_strides

SCALING_FACTOR = 0.476986  # HunyuanVideo's published latent scale
TILE_SAMPLE_SIZE = 256  # diffusers' tile_sample_min_height / _width
TILE_SAMPLE_STRIDE = 192  # diffusers' tile_sample_stride_height / _width
TILE_SAMPLE_FRAMES = 16  # diffusers' tile_sample_min_num_frames
TILE_SAMPLE_FRAME_STRIDE = 12  # diffusers' tile_sample_stride_num_frames
# maps of a level's width live at once per frame in one of its resnets: measured, with a
# margin (docs/encoders.md, "Memory")
MAPS_PER_FRAME = 7.5

# diffusers' AutoencoderKLHunyuanVideo defaults for the encoder half
DEFAULTS: dict[str, Any] = {
    "in_channels": 3,
    "latent_channels": 16,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "scaling_factor": SCALING_FACTOR,
    "spatial_compression_ratio": 8,
    "temporal_compression_ratio": 4,
    "mid_block_add_attention": True,
}


def encoder_spec(c: dict[str, Any]) -> EncoderSpec:
    widths = tuple(int(w) for w in c["block_out_channels"])
    strides = down_strides(
        len(widths), int(c["spatial_compression_ratio"]), int(c["temporal_compression_ratio"])
    )
    return EncoderSpec(
        in_channels=int(c["in_channels"]),
        latent_channels=int(c["latent_channels"]),
        widths=widths,
        layers=int(c["layers_per_block"]),
        groups=int(c["norm_num_groups"]),
        strides=tuple(strides),
        attention=bool(c["mid_block_add_attention"]),
    )


class Encoder(VAEEncoder):
    """``moments`` equals ``AutoencoderKLHunyuanVideo.encode(x).latent_dist.parameters``."""

    is_video = True
    channels_last = True  # a served copy on the CPU: faster, less memory (docs/encoders.md)
    supports_tiling = True

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__({**DEFAULTS, **config})
        self.spec = encoder_spec(self.config)
        self.encoder = EncoderNet(self.spec)
        z2 = 2 * self.spec.latent_channels
        self.quant_conv = nn.Conv3d(z2, z2, 1)

    # --- geometry ------------------------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return self.spec.latent_channels

    def _product(self, axis: int) -> int:
        out = 1
        for s in self.spec.strides:
            out *= s[axis] if s else 1
        return out

    @property
    def spatial_scale(self) -> int:
        return self._product(1)

    @property
    def temporal_scale(self) -> int:
        return self._product(0)

    def latent_frames(self, frames: int) -> int:
        for s in self.spec.strides:
            if s and s[0] == 2:
                frames = (frames - 1) // 2 + 1
        return frames

    # --- encoding ------------------------------------------------------------------------
    @torch.no_grad()
    def moments(self, x: Tensor, **options: Any) -> Tensor:
        return encoding.whole(partial(self._chunks, options=options), x, self._check)

    @torch.no_grad()
    def iter_moments(self, x: Tensor | Clip, **options: Any) -> Iterator[Tensor]:
        """Each temporal window's kept latent frames as soon as they are final, each window
        read from the clip only then; a clip in one window (or ``framewise=False``): one
        chunk (the mid block's attention spans all of a window's frames)."""
        yield from encoding.chunked(partial(self._chunks, options=options), x, self._check)

    def _check(self, shape: tuple[int, ...]) -> None:
        encoding.check_shape(shape, self.spec.in_channels, self.spatial_scale, self.frames_problem)

    def _chunks(self, clip: Clip, options: dict[str, Any]) -> Iterator[Tensor]:
        size = int(options.get("tile_sample_frames") or TILE_SAMPLE_FRAMES)
        if not options.get("framewise", True) or clip.shape[2] <= size:
            x = encoding.take(clip, 0, clip.shape[2], self.quant_conv.weight)
            yield self._frame(x, options)
            return
        ratio = int(self.config["temporal_compression_ratio"])
        step = int(options.get("tile_sample_frame_stride") or TILE_SAMPLE_FRAME_STRIDE)

        def run(x: Tensor) -> Tensor:
            return self._frame(x.to(self.quant_conv.weight), options)

        yield from encoding.iter_temporal_windows(run, clip, ratio, size, step)

    def _pass(self, x: Tensor) -> Tensor:
        return self.quant_conv(self.encoder(x))

    def _frame(self, x: Tensor, options: dict[str, Any]) -> Tensor:
        """One window: spatial tiles when asked and the frame is larger than one."""
        size = int(options.get("tile_sample_size") or TILE_SAMPLE_SIZE)
        stride = int(options.get("tile_sample_stride") or TILE_SAMPLE_STRIDE)
        if options.get("tiled") and max(x.shape[-2:]) > size:
            ratio = int(self.config["spatial_compression_ratio"])
            return encoding.tiled(self._pass, x, ratio, size, stride)
        return self._pass(x)

    def normalize(self, z: Tensor) -> Tensor:
        """HunyuanVideo pipelines' ``z * scaling_factor``."""
        return z * float(self.config["scaling_factor"])

    def stages(self) -> list[tuple[str, nn.Module]]:
        net = self.encoder
        head = [net.conv_norm_out, net.conv_act, net.conv_out, self.quant_conv]
        return encoding.stages([net.conv_in], net.down_blocks, net.mid_block, head)

    def working_bytes(
        self, input_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        """One pass's widest level (``memory``) over one window (``TILE_SAMPLE_FRAMES`` + 1
        frames, or the whole clip when it is no longer), and the moments (the windows', the
        kept ones and their concatenation). Attention holds O(T*H*W) (``attend``). Tiled
        (where the frame is larger than a tile): one tile's pass, and every tile's moments of
        the window held for the blend."""
        b, frames = input_shape[0], input_shape[2] if len(input_shape) == 5 else 1
        h, w = input_shape[-2:]
        pixels = b * h * w
        window = frames if frames <= TILE_SAMPLE_FRAMES else TILE_SAMPLE_FRAMES + 1
        cells = self.latent_frames(frames) * pixels // self.spatial_scale**2
        moments = 3 * 2 * self.spec.latent_channels * cells
        if not tiled or max(h, w) <= TILE_SAMPLE_SIZE:
            values = peak_values(self._levels(window, pixels), MAPS_PER_FRAME)
            return (values + moments) * element_size
        tiles = math.ceil(h / TILE_SAMPLE_STRIDE) * math.ceil(w / TILE_SAMPLE_STRIDE)
        tile = b * min(h, TILE_SAMPLE_SIZE) * min(w, TILE_SAMPLE_SIZE)
        values = peak_values(self._levels(window, tile), MAPS_PER_FRAME)
        tile_cells = self.latent_frames(window) * (tile // self.spatial_scale**2)
        held = tiles * 2 * self.spec.latent_channels * tile_cells  # the window's, for the blend
        return (values + held + moments) * element_size

    def _levels(self, frames: int, pixels: int) -> list[Level]:
        levels = []
        for width, stride in zip(self.spec.widths, self.spec.strides, strict=True):
            levels.append(Level(width, frames, pixels))
            if stride is not None:
                frames = (frames - 1) // stride[0] + 1
                pixels //= stride[1] * stride[2]
        return levels

    def probe_input(self, generator: torch.Generator) -> Tensor:
        """Two temporal windows (the gate checks their blend)."""
        side = self.spatial_scale * 4
        shape = (1, 3, TILE_SAMPLE_FRAMES + 1 + self.temporal_scale, side, side)
        return torch.rand(shape, generator=generator) * 2 - 1
