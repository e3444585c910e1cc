"""The LTX-Video decoder, exactly: every ``diffusers.AutoencoderKLLTXVideo`` decoder variant.

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

Every layer takes a ``Stream``: the temporal state that lets the same modules run a clip in
one pass (``Architecture.forward``) or as a stream of frame chunks and spatial tiles
(``streaming.py``, what ``decode.py``'s ``decode`` / ``iter_decode`` run). Injected noise is drawn once per
decode for the full frame (in diffusers' draw order) and cropped per tile, so a seed gives the
same noise in every mode.

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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.families.ops import conv3d

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


# --- per-decode state -------------------------------------------------------------------------
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


# --- small pure ops -----------------------------------------------------------------------
def depth_to_space(x: Tensor, channels: int) -> Tensor:
    """[B, 8c, T, H, W] -> [B, c, 2T, 2H, 2W]; channel (c, dt, dy, dx), frame-local."""
    b, _, t, h, w = x.shape
    x = x.reshape(b, channels, 2, 2, 2, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    return x.reshape(b, channels, 2 * t, 2 * h, 2 * w)


def timestep_features(t: Tensor) -> Tensor:
    """Sinusoidal [N] -> [N, 256] features, cos half first (diffusers' Timesteps, flip=True)."""
    half = TIME_PROJ_DIM // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    angles = t[:, None].float() * freqs.to(t.device)[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


# --- layers -------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """RMSNorm over channels (dim 1), statistics in float32, no weight; then a timestep's
    ``(shift, scale)`` when the model is timestep-conditioned."""

    def forward(self, x: Tensor, mod: tuple[Tensor, Tensor] | None = None) -> Tensor:
        var = x.float().pow(2).mean(1, keepdim=True)
        h = (x * torch.rsqrt(var + RMS_EPS)).to(x.dtype)
        return h if mod is None else h * (1 + mod[1]) + mod[0]


class Unpatchify(nn.Module):
    """conv_out's [B, c*pt*p*p, T, H, W] -> pixels; the width offset is the outer patch index."""

    def __init__(self, patch: int, patch_t: int) -> None:
        super().__init__()
        self.patch, self.patch_t = patch, patch_t

    def forward(self, x: Tensor) -> Tensor:
        b, ch, t, h, w = x.shape
        p, pt = self.patch, self.patch_t
        c = ch // (pt * p * p)
        x = x.reshape(b, c, pt, p, p, t, h, w).permute(0, 1, 5, 2, 6, 4, 7, 3)
        return x.reshape(b, c, t * pt, h * p, w * p)


class EdgeFrameConv3d(nn.Module):
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
        self.norm1 = RMSNorm()
        self.conv1 = spec.conv(cin, cout, 3)
        self.norm2 = RMSNorm()
        self.conv2 = spec.conv(cout, cout, 3)
        self.nonlinearity = nn.SiLU()
        self.norm3 = self.conv_shortcut = None
        if cin != cout:
            self.norm3 = nn.LayerNorm(cin, eps=spec.eps)
            self.conv_shortcut = spec.shortcut(cin, cout)
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
        h = self.norm1(x, mod and mod[:2])
        h = self._add_noise(self.conv1(self.nonlinearity(h), s), s, 0)
        h = self.norm2(h, mod and mod[2:])
        h = self._add_noise(self.conv2(self.nonlinearity(h), s), s, 1)
        return h + s.align(self, self._skip(x), h.shape[2])


class Upsampler(nn.Module):
    """Conv to 8x channels / factor, depth-to-space 2x in T, H, W, first frame dropped."""

    def __init__(self, cin: int, causal: bool, residual: bool, factor: int) -> None:
        super().__init__()
        self.conv = EdgeFrameConv3d(cin, cin * 8 // factor, 3, causal)
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
        self.time_stride = b.stride[0] if b.upsample else 1  # output frames per input frame
        if b.upsample:
            self.upsamplers = nn.ModuleList([spec.upsampler(b)])
            scale *= b.stride[1]
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
    stride: tuple[int, int, int] = (2, 2, 2)  # the upsampler's (T, H, W) factors


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

    # the layers this spec builds (LTX-2's spec, in ltx2.py, builds its own)
    def conv(self, cin: int, cout: int, kernel: int) -> nn.Module:
        return EdgeFrameConv3d(cin, cout, kernel, self.causal)

    def shortcut(self, cin: int, cout: int) -> nn.Module:
        return EdgeFrameConv3d(cin, cout, 1, self.causal)

    def upsampler(self, b: BlockSpec) -> nn.Module:
        return Upsampler(b.cout * b.factor, self.causal, b.residual, b.factor)


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


# --- the architecture ----------------------------------------------------------------------
class Architecture(nn.Module):
    """The LTX-Video decoder network of ``spec`` (``decoder_spec``, or LTX-2's ``ltx2_spec``);
    ``forward`` decodes a whole clip in one pass."""

    def __init__(self, config: dict[str, Any], spec: DecoderSpec) -> None:
        super().__init__()
        self.config, self.spec = dict(config), spec
        self.conv_in = spec.conv(spec.latent_channels, spec.mid_channels, 3)
        self.mid_block = MidBlock(spec.mid_channels, spec)
        self.up_blocks = nn.ModuleList()
        scale = 1
        for b in spec.blocks:
            self.up_blocks.append(UpBlock(b, spec, scale))
            scale *= b.stride[1] if b.upsample else 1
        last = spec.blocks[-1].cout if spec.blocks else spec.mid_channels
        out = spec.out_channels * spec.patch**2
        self.norm_out = RMSNorm()
        self.conv_act = nn.SiLU()
        self.conv_out = spec.conv(last, out, 3)
        self.unpatchify = Unpatchify(spec.patch, spec.patch_t)
        self.time_embedder = self.scale_shift_table = self.timestep_scale_multiplier = None
        if spec.timestep:
            self.timestep_scale_multiplier = nn.Parameter(torch.tensor(1000.0))
            self.time_embedder = TimeEmbedder(last * 2)
            self.scale_shift_table = nn.Parameter(torch.zeros(2, last))

    def forward(self, z: Tensor, cond: Conditioning | None = None) -> Tensor:
        """The whole clip in one pass: ``[B,C,T,H,W]`` -> ``[B,3,T',H',W']``."""
        s = Stream(self.conditioning(z, {}) if cond is None else cond, final=True)
        x = self.conv_in(z, s)
        x = self.mid_block(x, s)
        for block in self.up_blocks:
            x = block(x, s)
        return self.head(x, s)

    def head(self, x: Tensor, s: Stream) -> Tensor:
        """RMSNorm [+ timestep shift/scale] -> SiLU -> conv_out -> unpatchify."""
        h = self.norm_out(x, s.cond.mods.get(self))
        return self.unpatchify(self.conv_out(self.conv_act(h), s))

    def _noisy(self) -> bool:
        return any(r.per_channel_scale1 is not None for r in self._resnets())

    def option(self, options: dict[str, Any], key: str, default: Any) -> Any:
        """A request option, else the model config's value, else the default (None = unset)."""
        value = options.get(key)
        if value is None:
            value = self.config.get(key)
        return default if value is None else value

    def _resnets(self) -> Iterator[ResnetBlock]:
        """Every resnet in forward order (the order diffusers draws its noise in)."""
        yield from self.mid_block.resnets
        for block in self.up_blocks:
            if block.conv_in is not None:
                yield block.conv_in
            yield from block.resnets

    # --- conditioning ----------------------------------------------------------------------
    def conditioning(self, z: Tensor, options: dict[str, Any]) -> Conditioning:
        """What one decode shares across its chunks and tiles: timestep modulations and
        full-frame noise (from the ``timestep`` and ``seed`` options)."""
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
        seed = int(self.option(options, "seed", 0))
        gen = torch.Generator().manual_seed(seed)
        h, w = z.shape[-2:]
        for resnet in self._resnets():
            if resnet.per_channel_scale1 is None:
                continue
            shape = (h * resnet.noise_scale, w * resnet.noise_scale)
            first = torch.randn(shape, generator=gen)  # after conv1
            second = torch.randn(shape, generator=gen)  # after conv2
            cond.noise[resnet] = (first.to(z.device, z.dtype), second.to(z.device, z.dtype))
