"""The LTX-Video encoder family: ``Encoder`` over ``model.EncoderNet`` (0.9.x and LTX-2).

Options of ``moments`` / ``encode`` (unknown ones are ignored):
  tiled (bool): diffusers' spatial tiles (``enable_tiling``): each tile of
      ``tile_sample_size`` pixels every ``tile_sample_stride`` pixels (default 512 / 448)
      encoded on its own, seams blended in latent space; only where the frame is larger than
      one tile. Approximate (tiles do not see their neighbours): never the default.
  framewise (bool): diffusers' temporal windows (its ``use_framewise_decoding`` flag, which
      its encode reads too): a clip longer than ``tile_sample_frames`` (16) frames is encoded
      in windows of that many + 1 frames every ``tile_sample_frame_stride`` (8) frames,
      blended over their overlap in latent frames. Approximate: off by default, as there.
  chunk_frames (int): a causal encoder (``encoder_causal``, no temporal patch) runs as a
      stream of frame chunks, ``1 + chunk_frames`` frames then ``chunk_frames`` at a time (a
      multiple of ``temporal_scale``; default ``DEFAULT_CHUNK_LATENTS`` latent frames' worth;
      0: one pass, as the reference): exact, with memory flat in clip length; not with
      ``framewise`` or spatial tiles, nor on a count other than ``1 + k * temporal_scale``.
``iter_moments`` yields the stream's chunks, or the temporal windows' kept latent frames,
each read from the clip only then (else one chunk); ``moments`` is their concatenation.
Frames: the reference takes whole time patches and, at each space-to-depth downsampler,
``1 + stride * k`` frames (a stride-2 conv takes any count): ``1 + 8k`` for the 0.9.5+ and
LTX-2 layouts, any count for 0.9.0/0.9.1's. ``frames_problem`` names the rule, and
``moments`` refuses other counts with it (a ValueError) before any compute. A clip of
``1 + 8k`` frames gives ``1 + k`` latent frames (causal: frame 0 alone).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from app.families import encoding
from app.families.encoder import Clip, VAEEncoder
from app.families.encoder_memory import PAD_MAPS, Level, peak_values
from app.families.ltx.encoder.model import (
    DOWNSAMPLE_STRIDES,
    BlockSpec,
    EncodeChunkState,
    EncoderNet,
    EncoderSpec,
)
from app.families.ops import fewest_cells

VERSION_LTX2 = "ltx2"
TILE_SAMPLE_SIZE = 512  # diffusers' tile_sample_min_height / _width
TILE_SAMPLE_STRIDE = 448  # diffusers' tile_sample_stride_height / _width
TILE_SAMPLE_FRAMES = 16  # diffusers' tile_sample_min_num_frames
TILE_SAMPLE_FRAME_STRIDE = 8  # diffusers' tile_sample_stride_num_frames
# latent frames per chunk of the default stream (chunk_frames = this x temporal_scale): memory
# flat in clip length, little time lost to the chunks' edges (docs/encoders.md, "Memory")
DEFAULT_CHUNK_LATENTS = 4
# maps of a level's width live at once per frame in one of its resnets: measured, with a
# margin (docs/encoders.md, "Memory")
MAPS_PER_FRAME = 7.5

# diffusers' AutoencoderKLLTXVideo defaults for the encoder half (a config.json may omit them)
DEFAULTS: dict[str, Any] = {
    "in_channels": 3,
    "latent_channels": 128,
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["LTXVideoDownBlock3D"] * 4,
    "spatio_temporal_scaling": [True, True, True, False],
    "layers_per_block": [4, 3, 3, 3, 4],
    "downsample_type": ["conv"] * 4,
    "patch_size": 4,
    "patch_size_t": 1,
    "resnet_norm_eps": 1e-6,
    "encoder_causal": True,
    "scaling_factor": 1.0,
}
# AutoencoderKLLTX2Video's
LTX2_DEFAULTS: dict[str, Any] = {
    **DEFAULTS,
    "version": VERSION_LTX2,
    "block_out_channels": [256, 512, 1024, 2048],
    "down_block_types": ["LTX2VideoDownBlock3D"] * 4,
    "spatio_temporal_scaling": [True, True, True, True],
    "layers_per_block": [4, 6, 6, 2, 2],
    "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatiotemporal"],
    "encoder_spatial_padding_mode": "zeros",
}


def encoder_spec(config: dict[str, Any]) -> EncoderSpec:
    """diffusers' encoder arithmetic for 0.9.0/0.9.1 (``LTXVideoDownBlock3D``), 0.9.5+
    (``LTXVideo095DownBlock3D``) and LTX-2 (``version`` ltx2)."""
    c = config
    ltx2 = c.get("version") == VERSION_LTX2
    chans = [int(v) for v in c["block_out_channels"]]
    layers = [int(v) for v in c["layers_per_block"]]
    scaling = c["spatio_temporal_scaling"]
    if isinstance(scaling, bool):
        scaling = [scaling] * (len(layers) - 1)
    kinds = list(c["down_block_types"])
    v095 = not ltx2 and kinds[-1] == "LTXVideo095DownBlock3D"
    stem = int(c["latent_channels"]) if ltx2 else chans[0]
    n = len(chans) if ltx2 else len(chans) - (1 if v095 else 0)
    blocks, ch = [], stem
    for i in range(n):
        if ltx2:
            out = chans[i]
        elif v095:
            out = chans[i + 1]
        else:
            out = chans[i + 1] if i + 1 < n else chans[i]
        old = not ltx2 and kinds[i] == "LTXVideoDownBlock3D"
        kind = "conv" if old else str(c["downsample_type"][i])
        if kind not in DOWNSAMPLE_STRIDES:
            raise ValueError(f"downsample_type {kind!r}: one of {list(DOWNSAMPLE_STRIDES)}")
        blocks.append(
            BlockSpec(
                cin=ch,
                cout=out,
                layers=layers[i],
                downsample=kind if scaling[i] else None,
                conv_out=old and ch != out,
            )
        )
        if not old and (kind == "conv" or not scaling[i]) and ch != out:
            raise ValueError(f"down block {i}: {ch} -> {out} channels without a downsampler")
        ch = out
    return EncoderSpec(
        in_channels=int(c["in_channels"]),
        latent_channels=int(c["latent_channels"]),
        stem_channels=stem,
        blocks=tuple(blocks),
        mid_channels=ch,
        mid_layers=layers[-1],
        patch=int(c["patch_size"]),
        patch_t=int(c["patch_size_t"]),
        causal=bool(c["encoder_causal"]),
        eps=float(c["resnet_norm_eps"]),
        padding_mode=str(c.get("encoder_spatial_padding_mode", "zeros")),
        plain_shortcut=ltx2,
    )


class Encoder(VAEEncoder):
    """``moments`` equals ``AutoencoderKLLTXVideo`` / ``AutoencoderKLLTX2Video``
    ``.encode(x).latent_dist.parameters``."""

    is_video = True
    channels_last = True  # bf16 on the CPU: no copy of each output back (docs/encoders.md)

    def __init__(self, config: dict[str, Any]) -> None:
        base = LTX2_DEFAULTS if config.get("version") == VERSION_LTX2 else DEFAULTS
        super().__init__({**base, **config})
        self.spec = encoder_spec(self.config)
        self.encoder = EncoderNet(self.spec)
        encoding.register_latent_stats(self, self.config, self.spec.latent_channels)

    # --- geometry ------------------------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return self.spec.latent_channels

    def _strides(self, axis: int) -> list[int]:
        return [DOWNSAMPLE_STRIDES[b.downsample][axis] for b in self.spec.blocks if b.downsample]

    @property
    def spatial_scale(self) -> int:
        return self.spec.patch * math.prod(self._strides(1))

    @property
    def min_cells(self) -> int:
        return fewest_cells(self.spec.padding_mode)

    @property
    def temporal_scale(self) -> int:
        return self.spec.patch_t * math.prod(self._strides(0))

    def latent_frames(self, frames: int) -> int:
        t = frames // self.spec.patch_t
        for b in self.spec.blocks:
            if b.downsample == "conv":  # causal stride-2 conv over 2 + T frames
                t = (t - 1) // 2 + 1
            elif b.downsample:
                st = DOWNSAMPLE_STRIDES[b.downsample][0]
                t = (t + st - 1) // st
        return t

    def frames_problem(self, frames: int) -> str:
        """The reference's reshapes take only some frame counts (``_fits``): the rule in words,
        e.g. "LTX encodes 1 + 8k frames (1, 9, 17, ...): 8 frames is not one; trim the clip
        to 1 frame". Counts repeat with a period of ``temporal_scale`` frames."""
        if self._fits(frames):
            return ""
        period = self.temporal_scale
        firsts = [t for t in range(1, period + 1) if self._fits(t)]
        rule = " or ".join(f"{t} + {period}k" for t in firsts)
        examples = sorted(t + k * period for t in firsts for k in range(3))[:4]
        below = max((t for t in range(frames - 1, 0, -1) if self._fits(t)), default=0)
        trim = f"; trim the clip to {below} frame{'s' * (below > 1)}" if below else ""
        listed = ", ".join(map(str, examples))
        return f"LTX encodes {rule} frames ({listed}, ...): {frames} frames is not one{trim}"

    def _fits(self, frames: int) -> bool:
        """Whether the reference takes ``frames``: whole time patches, then at each
        space-to-depth downsampler (its first ``stride - 1`` frames repeated in front) whole
        groups, so ``1 + stride * k`` frames; a stride-2 conv takes any count."""
        if frames % self.spec.patch_t:
            return False
        t = frames // self.spec.patch_t
        for b in self.spec.blocks:
            st = DOWNSAMPLE_STRIDES[b.downsample][0] if b.downsample else 1
            if b.downsample != "conv" and (t - 1) % st:
                return False
            t = (t - 1) // st + 1
        return True

    def _scalings(self) -> int:
        scaling = self.config["spatio_temporal_scaling"]
        return sum(scaling) if not isinstance(scaling, bool) else len(self.spec.blocks) * scaling

    def _tile_ratio(self) -> int:
        """diffusers' ``spatial_compression_ratio`` (what its tiles are measured in)."""
        ratio = self.config.get("spatial_compression_ratio")
        return int(ratio) if ratio else self.spec.patch * 2 ** int(self._scalings())

    def _temporal_ratio(self) -> int:
        """diffusers' ``temporal_compression_ratio`` (what its windows are measured in)."""
        ratio = self.config.get("temporal_compression_ratio")
        return int(ratio) if ratio else self.spec.patch_t * 2 ** int(self._scalings())

    # --- encoding ------------------------------------------------------------------------
    @torch.no_grad()
    def moments(self, x: Tensor, **options: Any) -> Tensor:
        return encoding.whole(partial(self._chunks, options=options), x, self._check)

    @torch.no_grad()
    def iter_moments(self, x: Tensor | Clip, **options: Any) -> Iterator[Tensor]:
        """The stream's chunks (``stream_chunk``), or each temporal window's kept latent
        frames (``framewise``), each read from the clip only then; else one chunk."""
        yield from encoding.chunked(partial(self._chunks, options=options), x, self._check)

    def _check(self, shape: tuple[int, ...]) -> None:
        encoding.check_shape(shape, self.spec.in_channels, self.spatial_scale, self.frames_problem)

    def _chunks(self, clip: Clip, options: dict[str, Any]) -> Iterator[Tensor]:
        frames, like = clip.shape[2], self.encoder.conv_in.conv.weight
        window = int(options.get("tile_sample_frames") or TILE_SAMPLE_FRAMES)
        if options.get("framewise") and frames > window:
            step = int(options.get("tile_sample_frame_stride") or TILE_SAMPLE_FRAME_STRIDE)

            def run(x: Tensor) -> Tensor:
                return self._frame(x.to(like), options)

            ratio = self._temporal_ratio()
            yield from encoding.iter_temporal_windows(run, clip, ratio, window, step)
        elif chunk := self.stream_chunk(clip.shape, options):
            s = EncodeChunkState()
            starts = [0, *range(1 + chunk, frames, chunk)]
            for a, b in zip(starts, [*starts[1:], frames], strict=True):
                yield self.encoder(encoding.take(clip, a, b, like), s)
        else:
            yield self._frame(encoding.take(clip, 0, frames, like), options)

    @property
    def streams(self) -> bool:
        """Whether the encoder can run as a stream of frame chunks (causal, no time patch)."""
        return self.spec.causal and self.spec.patch_t == 1

    def stream_chunk(self, shape: tuple[int, ...], options: dict[str, Any]) -> int:
        """Input frames per chunk of the stream after the first ``1 + chunk`` for an input of
        ``shape``; 0: one pass (a non-causal encoder, temporal windows, spatial tiles, a clip
        of one chunk, or a count the stream cannot cut: not ``1 + k * temporal_scale``)."""
        if not self.streams or options.get("framewise") or self._tiles(shape, options):
            return 0
        chunk = options.get("chunk_frames")
        chunk = DEFAULT_CHUNK_LATENTS * self.temporal_scale if chunk is None else int(chunk)
        if chunk % self.temporal_scale:
            raise ValueError(f"chunk_frames {chunk}: a multiple of {self.temporal_scale}")
        frames = shape[2] if len(shape) == 5 else 1
        if not chunk or frames <= 1 + chunk or (frames - 1) % self.temporal_scale:
            return 0
        return chunk

    def _tiles(self, shape: tuple[int, ...], options: dict[str, Any]) -> bool:
        size = int(options.get("tile_sample_size") or TILE_SAMPLE_SIZE)
        return bool(options.get("tiled")) and max(shape[-2:]) > size

    def _frame(self, x: Tensor, options: dict[str, Any]) -> Tensor:
        """One pass, or spatial tiles when asked and the frame is larger than one tile."""
        if self._tiles(tuple(x.shape), options):
            size = int(options.get("tile_sample_size") or TILE_SAMPLE_SIZE)
            stride = int(options.get("tile_sample_stride") or TILE_SAMPLE_STRIDE)
            return encoding.tiled(self.encoder, x, self._tile_ratio(), size, stride)
        return self.encoder(x)

    def normalize(self, z: Tensor) -> Tensor:
        """LTX pipelines' ``_normalize_latents``: (z - mean) * scaling_factor / std."""
        return encoding.normalize(
            z, self.latents_mean, self.latents_std, float(self.config["scaling_factor"])
        )

    def stages(self) -> list[tuple[str, nn.Module]]:
        net = self.encoder
        head = [net.norm_out, net.conv_act, net.conv_out, net.shared_logvar]
        return encoding.stages([net.patchify, net.conv_in], net.down_blocks, net.mid_block, head)

    def working_bytes(
        self, input_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        """The widest level (``memory``) over one run, or conv_in's input where it is wider:
        the default stream's first chunk (``1 + chunk`` frames: flat in clip length) and its
        convs' carried frames, or the whole clip in one pass; and the moments (the chunks'
        and their concatenation)."""
        b, frames = input_shape[0], input_shape[2] if len(input_shape) == 5 else 1
        pixels = b * math.prod(input_shape[-2:])
        latent = 2 * self.spec.latent_channels * self.latent_frames(frames) * pixels
        latent //= self.spatial_scale**2
        chunk = self.stream_chunk(input_shape, {})
        run = (1 + chunk if chunk else frames) // self.spec.patch_t
        pixels //= self.spec.patch**2
        levels = peak_values(self._levels(run, pixels), MAPS_PER_FRAME)
        carry = int(pixels * self._carry_values_per_pixel()) if chunk else 0
        held = max(levels, self._stem_values(run, pixels)) + carry
        return (held + (2 if chunk else 1) * latent) * element_size

    def _carry_values_per_pixel(self) -> float:
        """What the stream carries from one chunk to the next per patchified input pixel:
        two input frames of every 3x3x3 conv (``EdgeFramePadConv3d._streamed``)."""
        spec, area = self.spec, 1.0
        total = spec.in_channels * spec.patch**2 * spec.patch_t  # conv_in's
        for block in spec.blocks:
            total += 2 * block.layers * block.cin * area  # each resnet's two convs
            if block.downsample:
                total += block.cin * area  # its conv (space-to-depth or strided)
                _, sh, sw = DOWNSAMPLE_STRIDES[block.downsample]
                area /= sh * sw
            if block.conv_out:
                total += (block.cin + block.cout) * area
        total += (2 * spec.mid_layers + 1) * spec.mid_channels * area  # the mid's, conv_out's
        return 2 * total

    def _stem_values(self, frames: int, pixels: int) -> int:
        """conv_in's input: the patchified clip, its padded copy, oneDNN's copy of that, and
        conv_in's output (narrower, counted as wide): four maps a frame."""
        channels = self.spec.in_channels * self.spec.patch**2 * self.spec.patch_t
        return int((4 * frames + 2 * PAD_MAPS) * channels * pixels)

    def _levels(self, frames: int, pixels: int) -> list[Level]:
        """Each down block's resnets (at its input width; 0.9.0's width-changing resnet after
        its downsampler), then the mid block's."""
        levels = []
        for block in self.spec.blocks:
            levels.append(Level(block.cin, frames, pixels))
            if block.downsample:
                st, sh, sw = DOWNSAMPLE_STRIDES[block.downsample]
                frames, pixels = -(-frames // st), pixels // (sh * sw)
            if block.conv_out:
                levels.append(Level(block.cout, frames, pixels))
        return [*levels, Level(self.spec.mid_channels, frames, pixels)]

    def probe_input(self, generator: torch.Generator) -> Tensor:
        """Two chunks of the default stream where the encoder streams (the gate checks the
        carries between them); else the first count past ``temporal_scale`` it takes."""
        side = self.spatial_scale * 2
        chunk = DEFAULT_CHUNK_LATENTS * self.temporal_scale if self.streams else 0
        frames = next(t for t in itertools.count(1 + chunk + self.temporal_scale) if self._fits(t))
        shape = (1, 3, frames, side, side)
        return torch.rand(shape, generator=generator) * 2 - 1
