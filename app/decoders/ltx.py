"""The LTX-Video decoder family: every ``diffusers.AutoencoderKLLTXVideo`` decoder variant.

latent [B,128,T,H,W] -> conv_in -> mid (resnets) -> up blocks ([conv_in resnet] [depth-to-space
upsampler] resnets) -> RMSNorm [+ timestep shift/scale] -> SiLU -> conv_out -> unpatchify
-> RGB [B,3,1+8(T-1),32H,32W] in [-1, 1]

Variants (all from one config, diffusers' decoder keys):
  0.9.0  plain: channel-changing ``conv_in`` resnets, upsamplers without residual.
  0.9.1  ``timestep_conditioning`` (per-block sinusoidal embedding -> shift/scale of every
         RMSNorm) and ``decoder_inject_noise`` (seeded spatial noise after each resnet conv),
         ``upsample_residual`` and ``upsample_factor`` = 2.
  0.9.5+ the same blocks without noise; ``decoder_causal`` either way.
Every 3x3x3 conv pads time by repeating the edge frame (2 on the left when causal, 1 each side
when not), RMSNorm normalizes over channels, and an upsampler maps each frame to two
(depth-to-space) and drops the very first output frame.

Streaming (``iter_decode``). Every layer is frame-local except the temporal convs, so the
decoder runs as a stream: latent frames go in ``chunk_frames`` at a time, each conv keeps the
last two input frames of its stream (its "carry"), a non-causal conv holds back its newest
output until it has seen the next frame (or the end), resnet and upsampler skips wait in a
small FIFO for their delayed branch, and stages hand frames on in bounded pieces. The temporal
stream recomputes nothing and approximates nothing; spatial tiles do approximate:
  * temporal chunking is EXACT for causal and non-causal decoders alike (measured against the
    one-pass decode: cosine 1.0, max-abs <= 5e-6 in float32; it is the same arithmetic on
    shorter tensors). Memory is bounded by the chunk, not the clip (carries are 2 frames per
    conv, FIFOs <= 2 frames per resnet). A non-causal decoder's first output waits for its
    temporal receptive field (about 1 + 2 per mid resnet latent frames), so its stream starts
    late; a causal one yields as soon as a chunk is in.
  * spatial tiling (``tile=True``) is BLENDED: overlapping latent tiles, each with its own
    carried stream state, decoded separately and mixed with linear ramps across the overlap.
    The spatial receptive field is wider than any practical overlap, so seams are approximate:
    measured on trained-like (``init_synthetic``) ltx-tiny weights at the default 16-cell
    tiles / 4-cell overlap, cosine 0.9987, max-abs 0.55, mean-abs 0.013 against the untiled
    decode (diffusers' own tiling at that geometry: 0.9973, 0.78, 0.027); more in
    docs/families/ltx.md.
Injected noise is drawn once per decode for the full frame (in diffusers' draw order) and
cropped per tile, so a seed gives the same noise in every mode.

Options of ``decode`` / ``iter_decode`` (unknown ones are ignored):
  timestep (float or per-batch list): timestep-conditioned models only; default
      ``config["decode_timestep"]``, else 0.0 (LTXPipeline's ``decode_timestep`` default).
  seed (int): noise injection; default ``config["seed"]``, else 0 (deterministic, so the
      parity gate and batching see repeatable output). Nothing is drawn without noise layers.
  chunk_frames (int): latent frames per temporal chunk (default 2; 0 = whole clip at once).
  tile (bool), tile_size / tile_overlap (latent cells, default 16 / 4): spatial tiling.
"""

from __future__ import annotations

import json
import math
import re
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

from app.decoders import ops
from app.decoders.base import VAEDecoder
from app.timing import NULL_TIMER, PhaseTimer

RMS_EPS = 1e-8  # diffusers' RMSNorm in the LTX blocks
TIME_PROJ_DIM = 256  # sinusoidal timestep features before each embedder MLP

# diffusers' AutoencoderKLLTXVideo defaults for the decoder half (a config.json may omit them)
DEFAULTS: dict[str, Any] = {
    "latent_channels": 128,
    "out_channels": 3,
    "decoder_block_out_channels": [128, 256, 512, 512],
    "decoder_layers_per_block": [4, 3, 3, 3, 4],
    "decoder_spatio_temporal_scaling": [True, True, True, False],
    "decoder_inject_noise": [False, False, False, False, False],
    "upsample_residual": [False, False, False, False],
    "upsample_factor": [1, 1, 1, 1],
    "timestep_conditioning": False,
    "patch_size": 4,
    "patch_size_t": 1,
    "resnet_norm_eps": 1e-6,
    "decoder_causal": False,
    "scaling_factor": 1.0,
}
DEFAULT_FPS = 25  # LTXPipeline's frame_rate default

SYNTHETIC: dict[str, dict[str, Any]] = {
    # The 0.9.1 topology in miniature: timestep conditioning, noise, residual 2x upsamplers.
    "ltx-tiny": {
        **DEFAULTS,
        "decoder_block_out_channels": [16, 32, 64],
        "decoder_layers_per_block": [1, 1, 1, 1],
        "decoder_spatio_temporal_scaling": [True, True, True],
        "decoder_inject_noise": [True, True, False, False],
        "upsample_residual": [True, True, True],
        "upsample_factor": [2, 2, 2],
        "timestep_conditioning": True,
        "decode_timestep": 0.05,
        "fps": DEFAULT_FPS,
    },
}


# --- small pure ops -----------------------------------------------------------------------
def rms_norm(x: Tensor) -> Tensor:
    """RMSNorm over channels (dim 1), statistics in float32, no affine."""
    var = x.float().pow(2).mean(1, keepdim=True)
    return (x * torch.rsqrt(var + RMS_EPS)).to(x.dtype)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale) + shift


def depth_to_space(x: Tensor, channels: int) -> Tensor:
    """[B, 8c, T, H, W] -> [B, c, 2T, 2H, 2W]; channel (c, dt, dy, dx), frame-local."""
    b, _, t, h, w = x.shape
    x = x.reshape(b, channels, 2, 2, 2, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    return x.reshape(b, channels, 2 * t, 2 * h, 2 * w)


def unpatchify(x: Tensor, p: int, pt: int) -> Tensor:
    """conv_out's [B, c*pt*p*p, T, H, W] -> pixels; the width offset is the outer patch index."""
    b, ch, t, h, w = x.shape
    c = ch // (pt * p * p)
    x = x.reshape(b, c, pt, p, p, t, h, w).permute(0, 1, 5, 2, 6, 4, 7, 3)
    return x.reshape(b, c, t * pt, h * p, w * p)


def conv3d(x: Tensor, conv: nn.Conv3d) -> Tensor:
    """``conv(x)``; float32 on the CPU goes straight to oneDNN. PyTorch's dispatch sends
    inputs with small B*C*T*H (short temporal chunks, low-res stages) to ``slow_conv3d``,
    measured 3-8x slower here; oneDNN is as fast or faster at every shape we run."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and torch.backends.mkldnn.enabled:
        pad, stride, dil = list(conv.padding), list(conv.stride), list(conv.dilation)
        return torch.ops.aten.mkldnn_convolution(x, conv.weight, conv.bias, pad, stride, dil, 1)
    return conv(x)


def timestep_features(t: Tensor) -> Tensor:
    """Sinusoidal [N] -> [N, 256] features, cos half first (diffusers' Timesteps, flip=True)."""
    half = TIME_PROJ_DIM // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    angles = t[:, None].float() * freqs.to(t.device)[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


Stage = Callable[[Tensor, "Stream"], Tensor]


# --- per-decode state ---------------------------------------------------------------------
@dataclass
class Conditioning:
    """What one decode shares across chunks and tiles: modulations and full-frame noise."""

    mods: dict[nn.Module, tuple[Tensor, ...]] = field(default_factory=dict)
    noise: dict[nn.Module, tuple[Tensor, Tensor]] = field(default_factory=dict)
    latent_hw: tuple[int, int] = (0, 0)


@dataclass
class Stream:
    """The temporal state of one tile's stream: conv carries, skip FIFOs, frames to drop."""

    cond: Conditioning
    stages: list[tuple[str, Stage, int]]  # (phase, stage, input frame rate vs the latent)
    origin: tuple[int, int] = (0, 0)  # the tile's top-left latent cell
    chunk: int = 0  # latent frames per piece (0: unbounded)
    final: bool = False  # the current call carries the stream's last frames
    carry: dict[nn.Module, Tensor] = field(default_factory=dict)
    fifo: dict[Any, Tensor] = field(default_factory=dict)
    to_drop: dict[Any, int] = field(default_factory=dict)

    def align(self, key: Any, skip: Tensor, frames: int) -> Tensor:
        """Queue skip frames; hand back the oldest ``frames`` of them (the branch lags)."""
        queued = self.fifo.pop(key, None)
        if queued is not None:
            skip = torch.cat([queued, skip], 2)
        if skip.shape[2] > frames:
            self.fifo[key] = skip[:, :, frames:].clone()  # clone: don't pin the whole chunk
            skip = skip[:, :, :frames]
        return skip

    def drop_first(self, key: Any, x: Tensor, count: int) -> Tensor:
        """Drop the first ``count`` frames of a stream, whichever calls they arrive in."""
        left = self.to_drop.setdefault(key, count)
        n = min(left, x.shape[2])
        self.to_drop[key] = left - n
        return x[:, :, n:] if n else x

    def noise_crop(self, full: Tensor, like: Tensor) -> Tensor:
        """This tile's window of a full-frame noise map at ``like``'s resolution."""
        scale = full.shape[0] // self.cond.latent_hw[0]
        y, x = self.origin[0] * scale, self.origin[1] * scale
        return full[y : y + like.shape[-2], x : x + like.shape[-1]]


# --- layers -------------------------------------------------------------------------------
class CausalConv3d(nn.Module):
    """Conv3d padded in time by repeating edge frames, run on a stream of frame chunks."""

    def __init__(self, cin: int, cout: int, kernel: int, causal: bool) -> None:
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, kernel, padding=(0, kernel // 2, kernel // 2))
        self.kt = kernel
        self.pad = (kernel - 1, 0) if causal else ((kernel - 1) // 2, (kernel - 1) // 2)

    def _run(self, x: Tensor) -> Tensor:
        if x.shape[2] < self.kt:
            b, _, _, h, w = x.shape
            return x.new_empty(b, self.conv.out_channels, 0, h, w)
        return conv3d(x, self.conv)

    def forward(self, x: Tensor, s: Stream) -> Tensor:
        if self.kt == 1:
            return self._run(x)
        left, right = self.pad
        prev = s.carry.get(self)
        if prev is None:  # stream start: replicate the first frame
            if not x.shape[2]:
                return self._run(x)
            prev = x[:, :, :1].expand(-1, -1, left, -1, -1)
        parts = [prev, x] if prev.shape[2] else [x]
        if s.final and right:  # stream end: replicate the last frame
            tail = x if x.shape[2] else prev
            parts.append(tail[:, :, -1:].expand(-1, -1, right, -1, -1))
        seq = torch.cat(parts, 2) if len(parts) > 1 else x
        if not s.final and seq.shape[2] >= self.kt - 1:
            s.carry[self] = seq[:, :, seq.shape[2] - self.kt + 1 :].clone()
        return self._run(seq)


class TimeEmbedder(nn.Module):
    """Sinusoidal features -> Linear -> SiLU -> Linear (diffusers' names kept)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = nn.Module()
        self.timestep_embedder.linear_1 = nn.Linear(TIME_PROJ_DIM, dim)
        self.timestep_embedder.linear_2 = nn.Linear(dim, dim)

    def forward(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        mlp = self.timestep_embedder
        h = mlp.linear_1(timestep_features(t).to(dtype))
        return mlp.linear_2(F.silu(h))


class ResnetBlock(nn.Module):
    """x + conv2(silu(mod(norm(conv1(silu(mod(norm(x)))))) + noise)) + noise."""

    def __init__(self, cin: int, cout: int, spec: DecoderSpec, noise: bool, scale: int) -> None:
        super().__init__()
        self.conv1 = CausalConv3d(cin, cout, 3, spec.causal)
        self.conv2 = CausalConv3d(cout, cout, 3, spec.causal)
        self.norm3 = self.conv_shortcut = None
        if cin != cout:
            self.norm3 = nn.LayerNorm(cin, eps=spec.eps)
            self.conv_shortcut = CausalConv3d(cin, cout, 1, spec.causal)
        self.per_channel_scale1 = self.per_channel_scale2 = None
        if noise:
            self.per_channel_scale1 = nn.Parameter(torch.zeros(cin, 1, 1))
            self.per_channel_scale2 = nn.Parameter(torch.zeros(cin, 1, 1))
        self.scale_shift_table = None
        if spec.timestep:
            self.scale_shift_table = nn.Parameter(torch.zeros(4, cin))
        self.noise_scale = scale  # spatial multiple of the latent grid at this block

    def _add_noise(self, h: Tensor, s: Stream, which: int) -> Tensor:
        if self.per_channel_scale1 is None:
            return h
        full = s.cond.noise[self][which]
        scale = (self.per_channel_scale1, self.per_channel_scale2)[which]
        return h + s.noise_crop(full, h) * scale[None, :, None]

    def _skip(self, x: Tensor) -> Tensor:
        if self.norm3 is not None:
            x = self.norm3(x.movedim(1, -1)).movedim(-1, 1)
        if self.conv_shortcut is not None:
            x = self.conv_shortcut._run(x)
        return x

    def forward(self, x: Tensor, s: Stream) -> Tensor:
        mod = s.cond.mods.get(self)
        h = rms_norm(x)
        if mod:
            h = modulate(h, mod[0], mod[1])
        h = self._add_noise(self.conv1(F.silu(h), s), s, 0)
        h = rms_norm(h)
        if mod:
            h = modulate(h, mod[2], mod[3])
        h = self._add_noise(self.conv2(F.silu(h), s), s, 1)
        return h + s.align(self, self._skip(x), h.shape[2])


class Upsampler(nn.Module):
    """Conv to 8x channels / factor, depth-to-space 2x in T, H, W, first frame dropped."""

    def __init__(self, cin: int, causal: bool, residual: bool, factor: int) -> None:
        super().__init__()
        self.conv = CausalConv3d(cin, cin * 8 // factor, 3, causal)
        self.residual, self.factor = residual, factor
        self.cout = cin // factor

    def forward(self, x: Tensor, s: Stream) -> Tensor:
        h = depth_to_space(self.conv(x, s), self.cout)
        h = s.drop_first((self, "main"), h, 1)
        if not self.residual:
            return h
        skip = depth_to_space(x, x.shape[1] // 8).repeat(1, 8 // self.factor, 1, 1, 1)
        skip = s.drop_first((self, "skip"), skip, 1)
        return h + s.align(self, skip, h.shape[2])


class MidBlock(nn.Module):
    def __init__(self, ch: int, spec: DecoderSpec) -> None:
        super().__init__()
        self.time_embedder = TimeEmbedder(ch * 4) if spec.timestep else None
        self.resnets = nn.ModuleList(
            ResnetBlock(ch, ch, spec, spec.mid_noise, 1) for _ in range(spec.mid_layers)
        )

    def forward(self, x: Tensor, s: Stream) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x, s)
        return x


class UpBlock(nn.Module):
    def __init__(self, b: BlockSpec, spec: DecoderSpec, scale: int) -> None:
        super().__init__()
        self.time_embedder = TimeEmbedder(b.cin * 4) if spec.timestep else None
        self.conv_in = None
        if b.cin != b.cout:
            self.conv_in = ResnetBlock(b.cin, b.cout, spec, b.noise, scale)
        self.upsamplers = None
        if b.upsample:
            up = Upsampler(b.cout * b.factor, spec.causal, b.residual, b.factor)
            self.upsamplers = nn.ModuleList([up])
            scale *= 2
        self.resnets = nn.ModuleList(
            ResnetBlock(b.cout, b.cout, spec, b.noise, scale) for _ in range(b.layers)
        )

    def forward(self, x: Tensor, s: Stream) -> Tensor:
        if self.conv_in is not None:
            x = self.conv_in(x, s)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, s)
        for resnet in self.resnets:
            x = resnet(x, s)
        return x


# --- config -------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockSpec:
    cin: int  # channels of the block's conv_in resnet (== cout: no conv_in)
    cout: int  # channels of its resnets
    layers: int
    upsample: bool
    residual: bool
    factor: int
    noise: bool


@dataclass(frozen=True)
class DecoderSpec:
    latent_channels: int
    mid_channels: int
    mid_layers: int
    mid_noise: bool
    blocks: tuple[BlockSpec, ...]
    out_channels: int
    patch: int
    patch_t: int
    causal: bool
    timestep: bool
    eps: float


def decoder_spec(config: dict[str, Any]) -> DecoderSpec:
    """diffusers' decoder arithmetic (lists given encoder-first, reversed here), validated."""
    c = {**DEFAULTS, **config}
    rev = {k: list(reversed(c[k])) for k in DEFAULTS if isinstance(DEFAULTS[k], list)}
    chans = rev["decoder_block_out_channels"]
    ch, blocks = chans[0], []
    for i, out in enumerate(chans):
        u = int(rev["upsample_factor"][i])
        b = BlockSpec(
            cin=ch // u,
            cout=out // u,
            layers=int(rev["decoder_layers_per_block"][i + 1]),
            upsample=bool(rev["decoder_spatio_temporal_scaling"][i]),
            residual=bool(rev["upsample_residual"][i]),
            factor=u,
            noise=bool(rev["decoder_inject_noise"][i + 1]),
        )
        _check_block(i, ch, b, bool(c["timestep_conditioning"]))
        blocks.append(b)
        ch = b.cout
    return DecoderSpec(
        latent_channels=int(c["latent_channels"]),
        mid_channels=chans[0],
        mid_layers=int(rev["decoder_layers_per_block"][0]),
        mid_noise=bool(rev["decoder_inject_noise"][0]),
        blocks=tuple(blocks),
        out_channels=int(c["out_channels"]),
        patch=int(c["patch_size"]),
        patch_t=int(c["patch_size_t"]),
        causal=bool(c["decoder_causal"]),
        timestep=bool(c["timestep_conditioning"]),
        eps=float(c["resnet_norm_eps"]),
    )


def _check_block(i: int, ch_in: int, b: BlockSpec, timestep: bool) -> None:
    """Reject what diffusers' decoder could build but never run (its forward would fail)."""
    entering = b.cout if b.cin != b.cout else ch_in
    if b.cin != b.cout and (b.cin != ch_in or b.noise or timestep):
        raise ValueError(
            f"up block {i}: a channel-changing conv_in needs factor 1, no noise "
            "and no timestep conditioning (as in diffusers' decoder)"
        )
    if b.upsample and b.cout * b.factor != entering:
        raise ValueError(
            f"up block {i}: upsampler expects {b.cout * b.factor} channels, gets {entering}"
        )
    if not b.upsample and entering != b.cout:
        raise ValueError(f"up block {i}: {entering} channels enter {b.cout}-channel resnets")


# --- the decoder --------------------------------------------------------------------------
class Decoder(VAEDecoder):
    """LTX-Video decoder; ``decode`` equals ``AutoencoderKLLTXVideo.decode(z).sample``."""

    family = "ltx"
    output_space = "signed"
    is_video = True

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__({**DEFAULTS, **config})
        spec = self.spec = decoder_spec(self.config)
        self.conv_in = CausalConv3d(spec.latent_channels, spec.mid_channels, 3, spec.causal)
        self.mid_block = MidBlock(spec.mid_channels, spec)
        self.up_blocks = nn.ModuleList()
        scale = 1
        for b in spec.blocks:
            self.up_blocks.append(UpBlock(b, spec, scale))
            scale *= 2 if b.upsample else 1
        last = spec.blocks[-1].cout if spec.blocks else spec.mid_channels
        out = spec.out_channels * spec.patch**2
        self.conv_out = CausalConv3d(last, out, 3, spec.causal)
        self.time_embedder = self.scale_shift_table = self.timestep_scale_multiplier = None
        if spec.timestep:
            self.timestep_scale_multiplier = nn.Parameter(torch.tensor(1000.0))
            self.time_embedder = TimeEmbedder(last * 2)
            self.scale_shift_table = nn.Parameter(torch.zeros(2, last))
        self._register_latent_stats()

    def _register_latent_stats(self) -> None:
        c = self.spec.latent_channels
        mean = torch.tensor(self.config.get("latents_mean") or [0.0] * c, dtype=torch.float32)
        std = torch.tensor(self.config.get("latents_std") or [1.0] * c, dtype=torch.float32)
        self.register_buffer("latents_mean", mean, persistent=False)
        self.register_buffer("latents_std", std, persistent=False)

    # --- geometry ------------------------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return self.spec.latent_channels

    @property
    def _ups(self) -> int:
        return sum(b.upsample for b in self.spec.blocks)

    @property
    def spatial_scale(self) -> int:
        return self.spec.patch * 2**self._ups

    @property
    def temporal_scale(self) -> int:
        return self.spec.patch_t * 2**self._ups

    def frames_out(self, latent_frames: int) -> int:
        return ((latent_frames - 1) * 2**self._ups + 1) * self.spec.patch_t

    def summary(self) -> dict[str, Any]:
        return {
            **super().summary(),
            "timestep_conditioning": self.spec.timestep,
            "inject_noise": self._noisy(),
            "causal": self.spec.causal,
            "fps": self.config.get("fps", DEFAULT_FPS),
        }

    def _noisy(self) -> bool:
        return any(r.per_channel_scale1 is not None for r in self._resnets())

    def probe_latent(self, generator: torch.Generator) -> Tensor:
        return torch.randn((1, self.latent_channels, 2, 4, 4), generator=generator)

    def denormalize(self, z: Tensor) -> Tensor:
        """LTXPipeline._denormalize_latents: z * std / scaling_factor + mean, per channel."""
        shape = (1, -1) + (1,) * (z.ndim - 2)
        mean = self.latents_mean.to(z.device, z.dtype).view(shape)
        std = self.latents_std.to(z.device, z.dtype).view(shape)
        return z * std / float(self.config["scaling_factor"]) + mean

    # --- decoding ------------------------------------------------------------------------
    def decode(self, z: Tensor, timer: PhaseTimer = NULL_TIMER, **options: Any) -> Tensor:
        """``[B,C,T,H,W]`` -> ``[B,3,T',H',W']``; an image latent ``[B,C,H,W]`` is decoded as
        one frame and returned as ``[B,3,H',W']``."""
        if z.ndim == 4:
            return self.decode(z.unsqueeze(2), timer, **options)[:, :, 0]
        total = self.frames_out(z.shape[2])
        out, pos = None, 0
        for piece in self.iter_decode(z, timer, **options):
            if out is None and piece.shape[2] == total:  # one pass: nothing to assemble
                return piece
            if out is None:  # preallocate: no second full copy of the video
                out = piece.new_empty(piece.shape[:2] + (total,) + piece.shape[3:])
            out[:, :, pos : pos + piece.shape[2]] = piece
            pos += piece.shape[2]
        assert out is not None and pos == total, (pos, total)
        return out

    @torch.no_grad()
    def iter_decode(
        self, z: Tensor, timer: PhaseTimer = NULL_TIMER, **options: Any
    ) -> Iterator[Tensor]:
        """Yield the decoded video in order as ``[B, 3, t, H, W]`` chunks (memory bounded)."""
        weight = self.conv_in.conv.weight
        z = z.to(device=weight.device, dtype=weight.dtype)
        if z.ndim == 4:
            z = z.unsqueeze(2)
        with timer.phase("condition"):
            cond = self._conditioning(z, options)
        chunk = int(self._option(options, "chunk_frames", 2))
        tiles = self._tiles(z, options)
        streams = [Stream(cond, self._stages(), (t[0], t[1]), chunk) for t in tiles]
        step = chunk or z.shape[2]
        for start in range(0, z.shape[2], step):
            final = start + step >= z.shape[2]
            part = z[:, :, start : start + step]
            if len(tiles) == 1:
                yield from self._flow(part, streams[0], final, timer)
                continue
            outs = [
                self._decode_tile(part, t, s, final, timer)
                for t, s in zip(tiles, streams, strict=True)
            ]
            if outs[0] is not None:
                with timer.phase("blend"):
                    yield self._blend(outs, tiles, z.shape[-2:])

    def _option(self, options: dict[str, Any], key: str, default: Any) -> Any:
        """A request option, else the model config's value, else the default (None = unset)."""
        value = options.get(key)
        if value is None:
            value = self.config.get(key)
        return default if value is None else value

    # --- streaming internals ---------------------------------------------------------------
    def _stages(self) -> list[tuple[str, Stage, int]]:
        """(phase name, stage, temporal rate of its input relative to the latent)."""
        stages: list[tuple[str, Stage, int]] = [
            ("conv_in", self.conv_in, 1),
            ("mid", self.mid_block, 1),
        ]
        rate = 1
        for i, block in enumerate(self.up_blocks):
            stages.append((f"up_{i}", block, rate))
            rate *= 2 if block.upsamplers is not None else 1
        stages.append(("conv_out", self._head, rate))
        return stages

    def _flow(self, x: Tensor, s: Stream, final: bool, timer: PhaseTimer) -> Iterator[Tensor]:
        """Push one latent chunk through every stage, in pieces of at most ``s.chunk`` latent
        frames' worth; ``final`` marks the stream's last chunk (each stage then flushes).

        Depth first: the deepest stage with pending input runs next, and a stage's output is
        referenced only by the queue of the stage after it, so memory is freed as it goes."""
        stages = s.stages
        queues: list[deque[tuple[Tensor, bool]]] = [deque() for _ in range(len(stages) + 1)]
        queues[0].append((x, final))
        del x
        while any(queues):
            k = max(i for i, q in enumerate(queues) if q)
            piece, last = queues[k].popleft()
            if k == len(stages):
                yield piece
                continue
            name, stage, _ = stages[k]
            s.final = last
            with timer.phase(name):
                y = stage(piece, s)
            del piece
            next_rate = stages[k + 1][2] if k + 1 < len(stages) else 0  # 0: the output
            queues[k + 1].extend(self._pieces(y, last, next_rate, s))
            del y

    @staticmethod
    def _pieces(y: Tensor, last: bool, rate: int, s: Stream) -> list[tuple[Tensor, bool]]:
        """Split a stage's output into the next stage's pieces; the last piece of the stream
        is passed on even when empty (the next stage must still flush)."""
        if not y.shape[2]:
            return [(y, True)] if last and rate else []
        parts = y.split(s.chunk * rate, dim=2) if (s.chunk and rate) else (y,)
        return [(p, last and i == len(parts) - 1) for i, p in enumerate(parts)]

    def _head(self, x: Tensor, s: Stream) -> Tensor:
        h = rms_norm(x)
        mod = s.cond.mods.get(self)
        if mod:
            h = modulate(h, mod[0], mod[1])
        h = self.conv_out(F.silu(h), s)
        return unpatchify(h, self.spec.patch, self.spec.patch_t)

    def _resnets(self) -> Iterator[ResnetBlock]:
        """Every resnet in forward order (the order diffusers draws its noise in)."""
        yield from self.mid_block.resnets
        for block in self.up_blocks:
            if block.conv_in is not None:
                yield block.conv_in
            yield from block.resnets

    # --- conditioning ----------------------------------------------------------------------
    def _conditioning(self, z: Tensor, options: dict[str, Any]) -> Conditioning:
        cond = Conditioning(latent_hw=(z.shape[-2], z.shape[-1]))
        if self.spec.timestep:
            self._timestep_mods(cond, self._timesteps(z, options), z.dtype)
        if self._noisy():
            self._draw_noise(cond, z, options)
        return cond

    def _timesteps(self, z: Tensor, options: dict[str, Any]) -> Tensor:
        t = options.get("timestep")
        t = self.config.get("decode_timestep", 0.0) if t is None else t
        t = torch.as_tensor(t, dtype=torch.float32, device=z.device).flatten()
        t = t.expand(z.shape[0]) if t.numel() == 1 else t
        return t * self.timestep_scale_multiplier

    def _timestep_mods(self, cond: Conditioning, t: Tensor, dtype: torch.dtype) -> None:
        """Each block's embedding + each resnet's table -> (shift1, scale1, shift2, scale2)."""
        b = t.shape[0]
        for block in [self.mid_block, *self.up_blocks]:
            emb = block.time_embedder(t, dtype).view(b, 4, -1, 1, 1, 1)
            for resnet in block.resnets:
                table = resnet.scale_shift_table[None, :, :, None, None, None]
                cond.mods[resnet] = (emb + table).unbind(1)
        emb = self.time_embedder(t, dtype).view(b, 2, -1, 1, 1, 1)
        cond.mods[self] = (emb + self.scale_shift_table[None, :, :, None, None, None]).unbind(1)

    def _draw_noise(self, cond: Conditioning, z: Tensor, options: dict[str, Any]) -> None:
        """Full-frame [H, W] noise per injection point, in forward order, on the CPU
        generator (so a seed means the same noise on every device and in every mode)."""
        seed = int(self._option(options, "seed", 0))
        gen = torch.Generator().manual_seed(seed)
        h, w = z.shape[-2:]
        for resnet in self._resnets():
            if resnet.per_channel_scale1 is None:
                continue
            shape = (h * resnet.noise_scale, w * resnet.noise_scale)
            first = torch.randn(shape, generator=gen)  # after conv1
            second = torch.randn(shape, generator=gen)  # after conv2
            cond.noise[resnet] = (first.to(z.device, z.dtype), second.to(z.device, z.dtype))

    # --- spatial tiling ---------------------------------------------------------------------
    def _tiles(self, z: Tensor, options: dict[str, Any]) -> list[tuple[int, int, int, int]]:
        """(y0, x0, h, w) latent tiles; one tile covering everything when tiling is off."""
        h, w = z.shape[-2:]
        if not self._option(options, "tile", False):
            return [(0, 0, h, w)]
        size = int(self._option(options, "tile_size", 16))
        overlap = min(int(self._option(options, "tile_overlap", 4)), size // 2)
        ys, xs = _starts(h, size, overlap), _starts(w, size, overlap)
        return [(y, x, min(size, h), min(size, w)) for y in ys for x in xs]

    def _decode_tile(
        self,
        part: Tensor,
        tile: tuple[int, int, int, int],
        s: Stream,
        final: bool,
        timer: PhaseTimer,
    ) -> Tensor | None:
        """This chunk's frames of one tile (None while its stream is still filling)."""
        y, x, h, w = tile
        pieces = list(self._flow(part[..., y : y + h, x : x + w], s, final, timer))
        return torch.cat(pieces, 2) if pieces else None

    def _blend(
        self,
        outs: list[Tensor | None],
        tiles: list[tuple[int, int, int, int]],
        latent_hw: Sequence[int],
    ) -> Tensor:
        """Weighted mix of tile outputs: linear ramps across each overlap, normalized."""
        sc = self.spatial_scale
        first = outs[0]
        assert first is not None
        b, c, t = first.shape[:3]
        out = first.new_zeros(b, c, t, latent_hw[0] * sc, latent_hw[1] * sc)
        norm = first.new_zeros(latent_hw[0] * sc, latent_hw[1] * sc)
        ys = sorted({tile[0] for tile in tiles})
        xs = sorted({tile[1] for tile in tiles})
        for (y, x, h, w), piece in zip(tiles, outs, strict=True):
            wy = _ramp(y, h, ys, sc, piece)
            wx = _ramp(x, w, xs, sc, piece)
            weight = wy[:, None] * wx[None, :]
            out[..., y * sc : (y + h) * sc, x * sc : (x + w) * sc] += piece * weight
            norm[y * sc : (y + h) * sc, x * sc : (x + w) * sc] += weight
        return out / norm


def _starts(n: int, size: int, overlap: int) -> list[int]:
    """Tile starts along one axis: fixed stride, the last tile flush with the end."""
    if n <= size:
        return [0]
    return list(range(0, n - size, size - overlap)) + [n - size]


def _ramp(start: int, size: int, starts: list[int], sc: int, like: Tensor) -> Tensor:
    """1-D weights of one tile: rising over the overlap with its predecessor, falling over
    the overlap with its successor (complementary ramps sum to 1)."""
    wgt = torch.ones(size * sc, dtype=like.dtype, device=like.device)

    def rise(ov: int) -> Tensor:
        return (torch.arange(ov, dtype=like.dtype, device=like.device) + 0.5) / ov

    i = starts.index(start)
    if i > 0:
        ov = (starts[i - 1] + size - start) * sc
        wgt[:ov] *= rise(ov)
    if i + 1 < len(starts):
        ov = (start + size - starts[i + 1]) * sc
        wgt[size * sc - ov :] *= 1 - rise(ov)
    return wgt


# --- synthetic weights --------------------------------------------------------------------
def init_synthetic(decoder: Decoder, generator: torch.Generator) -> None:
    """Deterministic trained-like weights: fan-in scaled convs, each residual branch's last
    conv scaled down (x0.1), small noise scales and modulation tables."""
    with torch.no_grad():
        for name, p in decoder.named_parameters():
            p.copy_(_synthetic_value(name, p, generator))


def _synthetic_value(name: str, p: Tensor, gen: torch.Generator) -> Tensor:
    randn = torch.randn(p.shape, generator=gen)
    if name.endswith("timestep_scale_multiplier"):
        return torch.tensor(1000.0)
    if "norm3.weight" in name:
        return torch.ones(p.shape)
    if name.endswith("bias"):
        return randn * 0.01
    if "per_channel_scale" in name:
        return randn * 0.02
    if name.endswith("scale_shift_table"):
        return randn * 0.05
    fan_in = p[0].numel() if p.ndim > 1 else 1
    value = randn / math.sqrt(fan_in)
    if name.endswith("conv2.conv.weight"):
        value *= 0.1
    return value


# --- checkpoint conversion ----------------------------------------------------------------
def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A diffusers ``vae/`` folder (or a pipeline folder holding one), or a Lightricks
    single-file checkpoint -> (config, decoder-only state dict in canonical names)."""
    source = Path(source)
    if source.is_dir():
        folder = source / "vae" if (source / "vae" / "config.json").exists() else source
        raw = json.loads((folder / "config.json").read_text())
        tensors = ops.read_safetensors_folder(folder)
        _refuse_ltx2(source, raw, tensors)
    else:
        raw, tensors = _read_single_file(source)
        with safe_open(str(source), framework="pt", device="cpu") as f:
            _refuse_ltx2(source, raw, f.keys())
    if any(".res_blocks." in k or "per_channel_statistics" in k for k in tensors):
        config, state = _from_lightricks(tensors, raw)
    else:
        config, state = _from_diffusers(tensors, raw)
    _check_state(config, state)
    return config, state


# LTX-2 (``AutoencoderKLLTX2Video``) shares LTX-Video's key names but not its arithmetic
# (reflect spatial padding, spatial-only / temporal-only upsamplers, plain conv shortcuts):
# decoded as 0.9.x it comes out wrong without a word, so it is refused by what gives it away.
_LTX2_CONFIG_KEYS = ("upsample_type", "encoder_spatial_padding_mode")
_LTX2_PADDING_KEYS = ("decoder_spatial_padding_mode", "spatial_padding_mode")
_LTX2_KEY_MARKERS = ("audio_vae.", "vocoder.", "model.diffusion_model.audio_")


def _refuse_ltx2(source: Path, raw: dict[str, Any], keys: Any) -> None:
    """Raise ``ValueError`` naming what marks ``source`` as LTX-2, if anything does."""
    seen = []
    if "LTX2" in str(raw.get("_class_name", "")):
        seen.append(f"_class_name {raw['_class_name']!r}")
    seen += [f"config key {k!r}" for k in _LTX2_CONFIG_KEYS if k in raw]
    seen += [f"{k}={raw[k]!r}" for k in _LTX2_PADDING_KEYS if raw.get(k, "zeros") != "zeros"]
    blocks = raw.get("decoder_blocks") or raw.get("blocks") or []
    seen += sorted(
        {f"decoder block {b[0]!r}" for b in blocks if b[0] in ("compress_space", "compress_time")}
    )
    marked = sorted({m for k in keys for m in _LTX2_KEY_MARKERS if k.startswith(m)})
    seen += [f"tensors under {m!r}" for m in marked]
    if source.is_dir() and any(k.endswith("conv_shortcut.weight") for k in keys):
        seen.append("plain conv_shortcut weights (0.9.x diffusers has conv_shortcut.conv)")
    if seen:
        raise ValueError(
            f"{source}: an LTX-2 (AutoencoderKLLTX2Video) checkpoint ({'; '.join(seen)}); "
            "the ltx family decodes LTX-Video 0.9.x only and would decode this one wrong"
        )


def _read_single_file(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Tensors of a safetensors file (VAE ones only) and its embedded JSON config, if any."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = json.loads((f.metadata() or {}).get("config", "{}") or "{}")
        keys = [k for k in f.keys() if k.startswith(("vae.", "decoder.", "per_channel"))]
        tensors = {k: f.get_tensor(k) for k in keys}
    if not tensors:
        raise ValueError(f"{path}: no LTX VAE tensors (expected vae.decoder.* or decoder.*)")
    return meta.get("vae", meta), tensors


def _from_diffusers(tensors: dict[str, Tensor], raw: dict[str, Any]) -> tuple[dict, dict]:
    config = {k: raw.get(k, v) for k, v in DEFAULTS.items()}
    state = {k[len("decoder.") :]: v for k, v in tensors.items() if k.startswith("decoder.")}
    _add_stats(config, tensors.get("latents_mean"), tensors.get("latents_std"))
    config["fps"] = DEFAULT_FPS
    return _jsonable(config), state


def _add_stats(config: dict[str, Any], mean: Tensor | None, std: Tensor | None) -> None:
    if mean is not None and std is not None:
        config["latents_mean"] = mean.float().flatten().tolist()
        config["latents_std"] = std.float().flatten().tolist()


def _jsonable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


# Lightricks' decoder is a flat list ``up_blocks.N`` of three kinds (in decode order):
#   res_x (``res_blocks.M``): resnets; res_x_y (``conv1`` directly): a channel-changing
#   resnet; compress_all (``conv.conv``): an upsampler. The first res_x is diffusers'
#   mid_block; every later res_x closes one diffusers up block [conv_in][upsampler] resnets.
_ORIG_BLOCK = re.compile(r"^up_blocks\.(\d+)\.(.+)$")


def _from_lightricks(tensors: dict[str, Tensor], raw: dict[str, Any]) -> tuple[dict, dict]:
    prefix = "vae." if any(k.startswith("vae.") for k in tensors) else ""
    dec = {k[len(prefix) + 8 :]: v for k, v in tensors.items() if k.startswith(prefix + "decoder.")}
    stats = {k.rsplit(".", 1)[-1]: v for k, v in tensors.items() if "per_channel_statistics" in k}
    kinds = _original_blocks(dec)
    targets = _block_targets(kinds)
    state: dict[str, Tensor] = {}
    for key, value in dec.items():
        state[_rename_original(key, targets)] = value
    config = _infer_config(state, raw)
    _add_stats(config, stats.get("mean-of-means"), stats.get("std-of-means"))
    return _jsonable(config), state


def _original_blocks(dec: dict[str, Tensor]) -> list[str]:
    """The kind of each original ``up_blocks.N``, in order."""
    kinds: dict[int, set[str]] = {}
    for key in dec:
        if m := _ORIG_BLOCK.match(key):
            rest = m.group(2)
            if rest.startswith(("res_blocks.", "time_embedder.")):
                kind = "res_x"
            else:
                kind = "compress" if rest.startswith("conv.") else "res_x_y"
            kinds.setdefault(int(m.group(1)), set()).add(kind)
    if sorted(kinds) != list(range(len(kinds))) or any(len(k) != 1 for k in kinds.values()):
        raise ValueError("Lightricks decoder: up_blocks.N are not a list of known block kinds")
    return [kinds[i].pop() for i in range(len(kinds))]


def _block_targets(kinds: list[str]) -> list[str]:
    """Original block index -> diffusers module path."""
    if not kinds or kinds[0] != "res_x":
        raise ValueError("Lightricks decoder: expected up_blocks.0 to be the mid res_x block")
    targets, block = ["mid_block"], 0
    names = {"res_x_y": "conv_in", "compress": "upsamplers.0"}
    for kind in kinds[1:]:
        if kind == "res_x":
            targets.append(f"up_blocks.{block}")
            block += 1
        else:
            targets.append(f"up_blocks.{block}.{names[kind]}")
    return targets


_ORIG_TOP = {"last_time_embedder.": "time_embedder.", "last_scale_shift_table": "scale_shift_table"}


def _rename_original(key: str, targets: list[str]) -> str:
    m = _ORIG_BLOCK.match(key)
    if m:
        key = f"{targets[int(m.group(1))]}.{m.group(2)}"
    for old, new in _ORIG_TOP.items():
        if key.startswith(old):
            key = new + key[len(old) :]
    key = key.replace("res_blocks.", "resnets.").replace("norm3.norm.", "norm3.")
    return re.sub(r"conv_shortcut\.(weight|bias)$", r"conv_shortcut.conv.\1", key)


def _infer_config(state: dict[str, Tensor], raw: dict[str, Any]) -> dict:
    """Decoder config from weight shapes; what weights cannot tell (upsampler residual,
    causality) from the checkpoint's embedded config, else as every release has it."""
    resnets = _count(state, r"^mid_block\.resnets\.(\d+)\.")
    blocks = _infer_blocks(state)
    uppers = [b for b in blocks if b["upsample"]]
    for b, residual in zip(uppers, _compress_residual(raw, len(uppers)), strict=True):
        b["residual"] = residual if residual is not None else b["factor"] > 1
    out = state["conv_out.conv.weight"].shape[0]
    patch = int(raw.get("patch_size") or round(math.sqrt(out / 3)))
    rev = {
        "decoder_block_out_channels": [b["cout"] * b["factor"] for b in blocks],
        "decoder_layers_per_block": [resnets] + [b["layers"] for b in blocks],
        "decoder_spatio_temporal_scaling": [b["upsample"] for b in blocks],
        "decoder_inject_noise": [_has_noise(state, "mid_block")] + [b["noise"] for b in blocks],
        "upsample_residual": [b.get("residual", False) for b in blocks],
        "upsample_factor": [b["factor"] for b in blocks],
    }
    config = {k: list(reversed(v)) for k, v in rev.items()}
    return {
        **DEFAULTS,
        **config,
        "latent_channels": state["conv_in.conv.weight"].shape[1],
        "out_channels": out // patch**2,
        "timestep_conditioning": "scale_shift_table" in state,
        "patch_size": patch,
        "decoder_causal": bool(raw.get("causal_decoder", False)),
        "scaling_factor": float(raw.get("scaling_factor", 1.0)),
        "fps": DEFAULT_FPS,
    }


def _infer_blocks(state: dict[str, Tensor]) -> list[dict[str, Any]]:
    blocks, i = [], 0
    while any(k.startswith(f"up_blocks.{i}.") for k in state):
        p = f"up_blocks.{i}"
        cout = state[f"{p}.resnets.0.conv1.conv.weight"].shape[0]
        up = state.get(f"{p}.upsamplers.0.conv.conv.weight")
        factor = up.shape[1] * 8 // up.shape[0] if up is not None else 1
        blocks.append(
            {
                "cout": cout,
                "layers": _count(state, rf"^{p}\.resnets\.(\d+)\."),
                "upsample": up is not None,
                "factor": factor,
                "noise": _has_noise(state, p),
            }
        )
        i += 1
    return blocks


def _compress_residual(raw: dict[str, Any], n: int) -> list[bool | None]:
    """``residual`` of each compress block in decode order, from Lightricks'
    ``decoder_blocks`` config (listed encoder-side first); None where unknown."""
    entries = []
    for block in reversed(raw.get("decoder_blocks") or raw.get("blocks") or []):
        params = block[1] if len(block) > 1 and isinstance(block[1], dict) else {}
        if str(block[0]).startswith("compress"):
            entries.append(params.get("residual"))
    return entries if len(entries) == n else [None] * n


def _count(state: dict[str, Tensor], pattern: str) -> int:
    rx = re.compile(pattern)
    found = {int(m.group(1)) for k in state if (m := rx.match(k))}
    return max(found) + 1 if found else 0


def _has_noise(state: dict[str, Tensor], prefix: str) -> bool:
    return any(k.startswith(prefix + ".") and "per_channel_scale1" in k for k in state)


def _check_state(config: dict[str, Any], state: dict[str, Tensor]) -> None:
    """The converted names and shapes must be exactly the decoder's (checked on meta)."""
    with torch.device("meta"):
        expected = {k: v.shape for k, v in Decoder(config).state_dict().items()}
    got = {k: v.shape for k, v in state.items()}
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    bad = [k for k in expected.keys() & got.keys() if expected[k] != got[k]]
    if missing or extra or bad:
        raise ValueError(
            "LTX checkpoint does not fit the inferred decoder config: "
            f"missing {missing[:5]}, unexpected {extra[:5]}, wrong shape {bad[:5]}"
        )
