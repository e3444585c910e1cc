"""The Wan encoder family: ``Encoder`` over ``model.EncoderNet`` (Wan 2.1, Wan 2.2 TI2V,
Qwen-Image), streamed over frame chunks with the causal convs' carries.

Options of ``moments`` / ``encode`` (unknown ones are ignored):
  chunk_frames (int): input frames per temporal chunk after the first ``1 + chunk_frames``
      (a multiple of 4; default 16; 0 = the whole clip at once). Exact either way.
  tiled (bool): diffusers' spatial tiles (``enable_tiling``), ``tile_sample_size`` /
      ``tile_sample_stride`` pixels (default 256 / 192, of the patchified frame in Wan 2.2,
      as the reference measures them); only where the frame is larger than one tile.
``iter_moments`` yields the stream's chunks in turn, each read from the clip only then (with
spatial tiles: one chunk, the whole clip); ``moments`` is their concatenation.
Frames: any count; the reference encodes the first ``1 + 4k`` (the rest are dropped) into
``1 + 4k / temporal_scale`` latent frames.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from app.families import encoding
from app.families.encoder import Clip, VAEEncoder
from app.families.encoder_memory import Level, peak_values
from app.families.wan.decoder.model import ZeroPadCausalConv3d
from app.families.wan.encoder.model import (
    Downsampler,
    EncoderNet,
    EncoderSpec,
    EncoderStream,
    patchify,
)

CHUNK = 4  # frames per cached step of the reference (after the first frame)
DEFAULT_CHUNK_FRAMES = 16
TILE_SAMPLE_SIZE = 256  # diffusers' tile_sample_min_height / _width
TILE_SAMPLE_STRIDE = 192  # diffusers' tile_sample_stride_height / _width
# maps of a level's width live at once per frame in one of its resnets (Wan 2.2's residual
# blocks add their shortcut and output): measured, with a margin (docs/encoders.md, "Memory")
MAPS_PER_FRAME = 6.5
RESIDUAL_MAPS_PER_FRAME = 7.75

# diffusers' AutoencoderKLWan defaults for the encoder half (a config.json may omit them)
DEFAULTS: dict[str, Any] = {
    "variant": "wan2.1",
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "is_residual": False,
    "in_channels": 3,
    "patch_size": None,
    "spatial_compression_ratio": 8,
}


def encoder_spec(c: dict[str, Any]) -> EncoderSpec:
    scales = {1 / 2**i for i in range(len(c["dim_mult"]))}
    if any(float(a) in scales for a in c["attn_scales"]):
        raise ValueError(
            f"attn_scales {c['attn_scales']}: attention in the down stages, which the "
            "reference builds but cannot run (its encoder hands them the feature cache)"
        )
    return EncoderSpec(
        in_channels=int(c["in_channels"]),
        base_dim=int(c["base_dim"]),
        z_dim=int(c["z_dim"]),
        dim_mult=tuple(int(m) for m in c["dim_mult"]),
        num_res_blocks=int(c["num_res_blocks"]),
        attn_scales=tuple(float(a) for a in c["attn_scales"]),
        temperal_downsample=tuple(bool(t) for t in c["temperal_downsample"]),
        is_residual=bool(c["is_residual"]),
    )


class Encoder(VAEEncoder):
    """``moments`` equals ``AutoencoderKLWan`` / ``AutoencoderKLQwenImage``
    ``.encode(x).latent_dist.parameters``."""

    is_video = True
    channels_last = True  # a served copy on the CPU: faster, less memory (docs/encoders.md)

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__({**DEFAULTS, **config})
        self.spec = encoder_spec(self.config)
        self.patch = int(self.config["patch_size"] or 1)
        self.encoder = EncoderNet(self.spec)
        self.quant_conv = ZeroPadCausalConv3d(self.spec.z_dim * 2, self.spec.z_dim * 2, 1)
        encoding.register_latent_stats(self, self.config, self.spec.z_dim)

    # --- geometry ------------------------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return self.spec.z_dim

    @property
    def spatial_scale(self) -> int:
        return self.patch * 2 ** (len(self.spec.dim_mult) - 1)

    @property
    def temporal_scale(self) -> int:
        downs = self.spec.temperal_downsample[: len(self.spec.dim_mult) - 1]
        return 2 ** sum(downs)

    def latent_frames(self, frames: int) -> int:
        return 1 + (frames - 1) // CHUNK * (CHUNK // self.temporal_scale)

    # --- encoding ------------------------------------------------------------------------
    @torch.no_grad()
    def moments(self, x: Tensor, **options: Any) -> Tensor:
        return encoding.whole(partial(self._chunks, options=options), x, self._check)

    @torch.no_grad()
    def iter_moments(self, x: Tensor | Clip, **options: Any) -> Iterator[Tensor]:
        """The stream's chunks (``1 + chunk_frames`` frames, then ``chunk_frames``), each
        read from the clip as it is encoded; one chunk with spatial tiles."""
        yield from encoding.chunked(partial(self._chunks, options=options), x, self._check)

    def _check(self, shape: tuple[int, ...]) -> None:
        channels = self.spec.in_channels // self.patch**2
        encoding.check_shape(shape, channels, self.spatial_scale, self.frames_problem)

    def _chunks(self, clip: Clip, options: dict[str, Any]) -> Iterator[Tensor]:
        chunk = int(options.get("chunk_frames", DEFAULT_CHUNK_FRAMES) or 0)
        if chunk % CHUNK:
            raise ValueError(f"chunk_frames {chunk}: a multiple of {CHUNK}")
        frames = 1 + (clip.shape[2] - 1) // CHUNK * CHUNK  # the frames the reference reads
        size = int(options.get("tile_sample_size") or TILE_SAMPLE_SIZE)
        if not options.get("tiled") or max(clip.shape[-2:]) // self.patch <= size:
            yield from self._stream(lambda a, b: self._read(clip, a, b), frames, chunk)
            return
        stride = int(options.get("tile_sample_stride") or TILE_SAMPLE_STRIDE)
        ratio = int(self.config["spatial_compression_ratio"]) // self.patch
        x = self._read(clip, 0, frames)  # tiles cut the whole clip: one chunk

        def run(tile: Tensor) -> Tensor:
            return encoding.joined(self._stream(lambda a, b: tile[:, :, a:b], frames, chunk))

        yield encoding.tiled(run, x, ratio, size, stride)

    def _read(self, clip: Clip, start: int, stop: int) -> Tensor:
        """Frames ``[start, stop)`` as the encoder takes them (Wan 2.2: patchified)."""
        x = encoding.take(clip, start, stop, self.quant_conv.weight)
        return patchify(x, self.patch) if self.patch > 1 else x

    def _stream(
        self, read: Callable[[int, int], Tensor], frames: int, chunk: int
    ) -> Iterator[Tensor]:
        """``frames`` frames through the encoder in frame chunks (``1 + chunk``, then
        ``chunk``; 0: all at once), each ``read`` when its turn comes."""
        s = EncoderStream()
        starts = [0, *range(1 + chunk, frames, chunk)] if chunk else [0]
        for a, b in zip(starts, [*starts[1:], frames], strict=True):
            s.final = b == frames
            yield self.quant_conv(self.encoder(read(a, b), s))

    def normalize(self, z: Tensor) -> Tensor:
        """Wan / Qwen-Image pipelines' ``(z - latents_mean) / latents_std``."""
        return encoding.normalize(z, self.latents_mean, self.latents_std)

    def stages(self) -> list[tuple[str, nn.Module]]:
        net = self.encoder
        head = [net.norm_out, net.nonlinearity, net.conv_out, self.quant_conv]
        return encoding.stages([net.conv_in], net.down_blocks, net.mid_block, head)

    def working_bytes(
        self, input_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        """The first (largest) chunk's widest level (``memory``), every causal conv's carried
        frames when more chunks follow, Wan 2.2's patchified chunk and the moments (each
        chunk's and their concatenation). Attention holds O(H*W) (``attend``)."""
        b, frames = input_shape[0], input_shape[2] if len(input_shape) == 5 else 1
        frames = 1 + (frames - 1) // CHUNK * CHUNK  # the frames the reference reads
        pixels = math.prod(input_shape[-2:]) // self.patch**2
        chunk = min(frames, 1 + DEFAULT_CHUNK_FRAMES)
        maps = RESIDUAL_MAPS_PER_FRAME if self.spec.is_residual else MAPS_PER_FRAME
        values = peak_values(self._levels(chunk, b * pixels), maps)
        if frames > chunk:
            values += int(b * pixels * self.carry_values_per_pixel())
        if self.patch > 1:
            values += b * self.spec.in_channels * chunk * pixels
        cells = self.latent_frames(frames) * pixels // 4 ** (len(self.spec.dim_mult) - 1)
        return (values + 2 * b * 2 * self.spec.z_dim * cells) * element_size

    def _levels(self, frames: int, pixels: int) -> list[Level]:
        """Each down stage's resnets (the last one's: the mid block's too)."""
        levels, dims = [], [self.spec.base_dim * m for m in self.spec.dim_mult]
        for i, width in enumerate(dims):
            levels.append(Level(width, frames, pixels))
            pixels //= 4
            if i < len(dims) - 1 and self.spec.temperal_downsample[i]:
                frames = (frames + 1) // 2
        return levels

    def carry_values_per_pixel(self) -> float:
        """Values of every causal conv's carried frames (``EncoderStream``) per (patchified)
        input pixel: what the stream holds from one chunk to the next."""
        total, area = 0.0, 1.0
        for module in self.encoder.modules():
            if isinstance(module, Downsampler):
                area /= 4
                if module.time_conv is not None:
                    total += module.time_conv.in_channels * area  # one frame
            elif isinstance(module, ZeroPadCausalConv3d) and module.kernel_size[0] > 1:
                total += (module.kernel_size[0] - 1) * module.in_channels * area
        return total

    def probe_input(self, generator: torch.Generator) -> Tensor:
        """Two chunks of the default stream (the gate checks the carries between them)."""
        side = self.spatial_scale * 4
        shape = (1, 3, 1 + DEFAULT_CHUNK_FRAMES + CHUNK, side, side)
        return torch.rand(shape, generator=generator) * 2 - 1
