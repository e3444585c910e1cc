"""The MiniMax-H3 encoder family: ``Encoder`` over ``model.EncoderNet`` with the reference's
clips and tiles, which are part of its output (it ships with tiling on).

A clip of more than one frame is padded with copies of its last frame to a multiple of
``clip_length`` (17) frames; each clip is encoded on its own; the last ``token_drop`` (3)
latent frames of the whole are dropped. One frame is encoded alone (no padding, no drop).
Frames: any count, as the reference. ``iter_moments`` yields each clip's latent frames as it
is encoded, each clip read only then; the drop cuts the last (the count is known: nothing is
held back); ``moments`` is their concatenation.
Each clip is cut into ``tile_sample_size`` (256) pixel tiles whose overlaps (at least
``tile_sample_overlap``, 64) grow in whole latent cells until the tiles cover the frame;
the tiles' latents are cross-faded over the overlaps.

Options of ``moments`` / ``encode`` (unknown ones are ignored):
  tiled (bool, default True: the reference's own setting), tile_sample_size,
  tile_sample_overlap (pixels).
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
from app.families.minimax_h3.decoder.schedule import split_tiles, stitch_tiles
from app.families.minimax_h3.encoder.model import EncoderNet, EncoderSpec
from app.families.ops import fewest_cells

TILE_SAMPLE_SIZE = 256  # diffusers' tile_sample_min_height / _width
TILE_SAMPLE_OVERLAP = 64  # diffusers' tile_sample_min_overlap_height / _width
# maps of a level's width live at once per frame in one of its resnets: measured, with a
# margin (docs/encoders.md, "Memory")
MAPS_PER_FRAME = 7.5

# diffusers' AutoencoderKLMiniMaxH3 defaults for the encoder half
DEFAULTS: dict[str, Any] = {
    "in_channels": 3,
    "latent_channels": 24,
    "block_out_channels": [128, 256, 256, 512, 512, 1024],
    "layers_per_block": 2,
    "spatial_downsample_factors": [2, 2, 2, 2, 1, 1],
    "temporal_downsample_factors": [1, 2, 2, 1, 1, 1],
    "norm_num_groups": 32,
    "norm_eps": 1e-6,
    "spatial_padding_mode": "reflect",
    "clip_length": 17,
    "token_drop": 3,
    "latents_mean": None,  # None = zeros
    "latents_std": None,  # None = ones
}


def encoder_spec(c: dict[str, Any]) -> EncoderSpec:
    spatial = tuple(int(f) for f in c["spatial_downsample_factors"])
    temporal = tuple(int(f) for f in c["temporal_downsample_factors"])
    if any(f not in (1, 2) for f in spatial + temporal):
        raise ValueError(f"downsample factors {spatial} / {temporal}: each 1 or 2")
    return EncoderSpec(
        in_channels=int(c["in_channels"]),
        latent_channels=int(c["latent_channels"]),
        widths=tuple(int(w) for w in c["block_out_channels"]),
        layers=int(c["layers_per_block"]),
        spatial=spatial,
        temporal=temporal,
        groups=int(c["norm_num_groups"]),
        eps=float(c["norm_eps"]),
        padding_mode=str(c["spatial_padding_mode"]),
    )


class Encoder(VAEEncoder):
    """``moments`` equals ``AutoencoderKLMiniMaxH3.encode(x).latent_dist.parameters``."""

    is_video = True
    channels_last = True  # a served copy on the CPU: faster, less memory (docs/encoders.md)

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__({**DEFAULTS, **config})
        self.spec = encoder_spec(self.config)
        self.encoder = EncoderNet(self.spec)
        z2 = 2 * self.spec.latent_channels
        self.quant_conv = nn.Conv3d(z2, z2, 1)
        encoding.register_latent_stats(self, self.config, self.spec.latent_channels)

    # --- geometry ------------------------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return self.spec.latent_channels

    @property
    def spatial_scale(self) -> int:
        return math.prod(self.spec.spatial)

    @property
    def min_cells(self) -> int:
        return fewest_cells(self.spec.padding_mode)

    @property
    def temporal_scale(self) -> int:
        return math.prod(self.spec.temporal)

    def _clip_latents(self, frames: int) -> int:
        for f in self.spec.temporal:
            frames = -(-frames // f)  # a causal stride-f conv over 2 + T frames
        return frames

    def latent_frames(self, frames: int) -> int:
        if frames == 1:
            return 1
        length = int(self.config["clip_length"])
        clips = -(-frames // length)
        return clips * self._clip_latents(length) - int(self.config["token_drop"])

    # --- encoding ------------------------------------------------------------------------
    @torch.no_grad()
    def moments(self, x: Tensor, **options: Any) -> Tensor:
        return encoding.whole(partial(self._chunks, options=options), x, self._check)

    @torch.no_grad()
    def iter_moments(self, x: Tensor | Clip, **options: Any) -> Iterator[Tensor]:
        """Each ``clip_length`` clip's latent frames, each clip read from the input only
        then (the last padded); the dropped frames are never yielded."""
        yield from encoding.chunked(partial(self._chunks, options=options), x, self._check)

    def _check(self, shape: tuple[int, ...]) -> None:
        encoding.check_shape(shape, self.spec.in_channels, self.spatial_scale, self.frames_problem)

    def _chunks(self, clip: Clip, options: dict[str, Any]) -> Iterator[Tensor]:
        frames, like = clip.shape[2], self.quant_conv.weight
        length = 1 if frames == 1 else int(self.config["clip_length"])  # one frame: alone
        left = self.latent_frames(frames)  # the count is known: the drop cuts the last clips
        for start in range(0, frames, length):
            if left <= 0:
                break
            x = encoding.take(clip, start, start + length, like)
            if x.shape[2] < length:  # the last clip, padded with copies of its last frame
                x = torch.cat([x, x[:, :, -1:].expand(-1, -1, length - x.shape[2], -1, -1)], 2)
            m = self._clip(x, options)[:, :, :left]
            left -= m.shape[2]
            yield m

    def _pass(self, x: Tensor) -> Tensor:
        return self.quant_conv(self.encoder(x))

    def _clip(self, x: Tensor, options: dict[str, Any]) -> Tensor:
        """One temporal clip, in the reference's cross-faded tiles (unless ``tiled=False``)."""
        if options.get("tiled") is False:
            return self._pass(x)
        size = int(options.get("tile_sample_size") or TILE_SAMPLE_SIZE)
        overlap = int(options.get("tile_sample_overlap") or TILE_SAMPLE_OVERLAP)
        ratio = self.spatial_scale
        ys, hs, yo = split_tiles(x.shape[-2], ratio, size, overlap)
        xs, ws, xo = split_tiles(x.shape[-1], ratio, size, overlap)
        if len(ys) == len(xs) == 1:
            return self._pass(x)
        tiles = [
            [self._pass(x[..., y : y + h, x0 : x0 + w]) for x0, w in zip(xs, ws, strict=True)]
            for y, h in zip(ys, hs, strict=True)
        ]
        th, tw = tiles[0][0].shape[-2:]
        lys, lxs = [y // ratio for y in ys], [x0 // ratio for x0 in xs]
        size_hw = (lys[-1] + th, lxs[-1] + tw)
        lyo, lxo = [o // ratio for o in yo], [o // ratio for o in xo]
        return stitch_tiles(tiles, (lys, lxs), (lyo, lxo), size_hw)

    def keeps_float32(self, name: str) -> bool:
        """Every parameter: the reference pins its encoder and quant_conv to float32
        (``_keep_in_fp32_modules``) whatever the pipeline's dtype."""
        return True

    def normalize(self, z: Tensor) -> Tensor:
        """The MiniMax-H3 pipeline's ``(z - latents_mean) / latents_std``."""
        return encoding.normalize(z, self.latents_mean, self.latents_std)

    def stages(self) -> list[tuple[str, nn.Module]]:
        net = self.encoder
        head = [net.norm_out, net.conv_act, net.conv_out, self.quant_conv]
        return encoding.stages([net.conv_in], net.down_blocks, None, head)

    def working_bytes(
        self, input_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        """One pass's widest level (``memory``) over one clip (``clip_length`` frames, or the
        one frame of an image) of one tile, the padded last clip (a copy of its frames) and the
        moments (the tiles', the clips' and their concatenation)."""
        b, frames = input_shape[0], input_shape[2] if len(input_shape) == 5 else 1
        height, width = input_shape[-2:]
        length = int(self.config["clip_length"])
        clip = 1 if frames == 1 else length
        side = TILE_SAMPLE_SIZE  # tiles are exactly this wide, or the whole frame
        tile = b * min(height, side) * min(width, side)
        values = peak_values(self._levels(clip, tile), MAPS_PER_FRAME)
        padded = length if frames > 1 and frames % length else 0
        pixels = b * height * width
        cells = self.latent_frames(frames) * pixels // self.spatial_scale**2
        latent = 2 * self.spec.latent_channels * cells
        return (values + self.spec.in_channels * padded * pixels + 3 * latent) * element_size

    def _levels(self, frames: int, pixels: int) -> list[Level]:
        levels = []
        spec = self.spec
        for width, ft, fs in zip(spec.widths, spec.temporal, spec.spatial, strict=True):
            levels.append(Level(width, frames, pixels))
            frames, pixels = -(-frames // ft), pixels // fs**2
        return levels

    def probe_input(self, generator: torch.Generator) -> Tensor:
        """Two clips, the second padded and cut by the drop."""
        side = self.spatial_scale * 2
        length = int(self.config["clip_length"])
        shape = (1, 3, length + length // 2, side, side)
        return torch.rand(shape, generator=generator) * 2 - 1
