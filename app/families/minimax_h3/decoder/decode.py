"""The MiniMax-H3 family served: ``Decoder`` = ``model.Architecture`` behind ``VAEDecoder``.

``decode`` / ``iter_decode`` run the reference's 256-px spatial tiles (batched into block-stack
calls of at most ``max_batch_tokens`` tokens) and its temporal clips (``schedule.py``) over
``forward``. One class serves both variants: a config with ``decoder_rope_axes: 2`` is
MiniMax-H3-Image (``image``: ``[B,C,H,W]`` -> ``[B,3,16H,16W]``, a ``[B,C,T,H,W]`` stack decoded
frame by frame), any other the video decoder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from app.families.decoder import VAEDecoder
from app.families.minimax_h3.decoder import fast
from app.families.minimax_h3.decoder.model import FP32_SUFFIXES, Architecture
from app.families.minimax_h3.decoder.schedule import (
    TILE,
    ClipPlan,
    clip_plan,
    crossfade,
    split_tiles,
    stitch_tiles,
)
from app.telemetry import timing

DEFAULT_BATCH_TOKENS = 16384  # tokens per block-stack call when tiles are batched
# Tokens per call by device type (issue 23.7): a GPU keeps 16,384 until the GPU proof's
# `video` section measures GPU_BATCH_TOKEN_CANDIDATES on a card.
BATCH_TOKENS = {"cpu": DEFAULT_BATCH_TOKENS, "cuda": DEFAULT_BATCH_TOKENS}
GPU_BATCH_TOKEN_CANDIDATES = (16384, 32768, 65536)


def batch_tokens_for(device: torch.device) -> int:
    """Tokens per block-stack call on ``device`` (a request's ``max_batch_tokens`` wins)."""
    return BATCH_TOKENS.get(device.type, DEFAULT_BATCH_TOKENS)


# Working memory of one block-stack call per token, in values of the compute dtype per model
# dimension (measured on the meta device with tests/test_memory_estimate.py): the float32
# residual stream and its copy, q/k/v and the attention output, the SwiGLU projection.
CALL_VALUES_PER_TOKEN_PER_DIM = 28


def is_image_config(config: dict[str, Any]) -> bool:
    """MiniMax-H3-Image: RoPE over (h, w) only."""
    return int(config.get("decoder_rope_axes", 3)) == 2


class Decoder(Architecture, VAEDecoder):
    """MiniMax-H3's decoder: video ``[B,C,T,h,w]`` -> ``[B,3,T',16h,16w]``, or the image
    variant (``self.image``, ``is_video`` False) from an image config."""

    output_space = "imagenet"
    is_video = True  # the image variant shadows it per instance
    cpu_margin = 1.75  # the resident set's growth in bf16 and exact (docs/decoders.md)
    gpu_margin = 3.2  # the H200 proof's peak over the estimate (docs/decoders.md)
    native_size = (768, 1344)

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.image = is_image_config(self.config)
        if self.image:
            if self.config["patch_size_t"] != 1:
                raise ValueError("the image variant needs patch_size_t 1")
            self.is_video = False

    # --- geometry ---------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return int(self.config["latent_channels"])

    @property
    def spatial_scale(self) -> int:
        return int(self.config["patch_size"])

    @property
    def temporal_scale(self) -> int:
        return int(self.config["patch_size_t"])

    def frames_out(self, latent_frames: int) -> int:
        return latent_frames if self.image else self.plan(latent_frames).frames

    def plan(self, latent_frames: int) -> ClipPlan:
        cfg = self.config
        return clip_plan(latent_frames, cfg["patch_size_t"], cfg["clip_length"], cfg["token_drop"])

    def working_bytes(
        self, latent_shape: tuple[int, ...], element_size: int, tiled: bool = False
    ) -> int:
        """The decoded chunks (``decode`` concatenates them), plus one block-stack call."""
        cfg = self.config
        frames = latent_shape[2] if len(latent_shape) == 5 else 1
        clip = 1 if self.image else min(frames, int(cfg["clip_length"]))
        cells = TILE // self.spatial_scale
        h, w = min(latent_shape[-2], cells), min(latent_shape[-1], cells)
        tile_tokens = clip * h * w + cfg["decoder_num_register_tokens"] + 1
        tiles = latent_shape[0] * -(-latent_shape[-2] // cells) * -(-latent_shape[-1] // cells)
        device = next(self.parameters()).device
        per_call = min(max(1, batch_tokens_for(device) // tile_tokens), tiles) * tile_tokens
        dim = cfg["decoder_num_attention_heads"] * cfg["decoder_attention_head_dim"]
        call = per_call * dim * CALL_VALUES_PER_TOKEN_PER_DIM
        return int((self.output_values(latent_shape) + call) * element_size)

    def summary(self) -> dict[str, Any]:
        cfg = self.config
        heads = cfg["decoder_num_attention_heads"]
        return super().summary() | {
            "variant": "video" if self.is_video else "image",
            "layers": cfg["decoder_num_layers"],
            "dim": heads * cfg["decoder_attention_head_dim"],
            "heads": heads,
        }

    def probe_latent(self, generator: torch.Generator, tiled: bool = False) -> Tensor:
        # one full 256-px tile, one latent frame: a few hundred tokens
        cells = max(1, TILE // self.spatial_scale)
        shape = (1, self.latent_channels) + (() if self.image else (1,))
        return torch.randn(shape + (cells, cells), generator=generator)

    def denormalize(self, z: Tensor) -> Tensor:
        """``z * latents_std + latents_mean`` per channel, as the pipeline does."""
        shape = (1, -1) + (1,) * (z.ndim - 2)
        mean = torch.tensor(self.config["latents_mean"], device=z.device).view(shape)
        std = torch.tensor(self.config["latents_std"], device=z.device).view(shape)
        return z * std + mean

    def stages(self) -> list[tuple[str, nn.Module]]:
        vit = self.decoder
        return [
            ("embed", self.post_quant_conv),
            ("embed", vit.proj_in),
            ("blocks", vit.transformer_blocks),
            ("head", vit.norm_out),
            ("head", vit.proj_out),
            ("unpatchify", self.unpatchify),
        ]

    def fine_stages(self) -> list[tuple[str, nn.Module]]:
        """Inside the blocks, for profiling: ``norm``, ``qkv``, ``attention``, ``out``, ``ffn``
        (instrument these beside ``stages()``; ``blocks`` then holds their sum)."""
        found: list[tuple[str, nn.Module]] = []
        for block in self.decoder.transformer_blocks:
            a = block.attn
            found += [("norm", block.norm1), ("norm", block.norm2), ("ffn", block.ff)]
            found += [("qkv", m) for m in (a.to_q, a.to_k, a.to_v, a.qk_norm)]
            found += [("attention", a.attend), ("out", a.to_out[0])]
        return found

    def keeps_float32(self, name: str) -> bool:
        # the norms and layer scales, as the reference pins them (``_apply`` below)
        return name.endswith(FP32_SUFFIXES)

    def optimize(self) -> None:
        fast.optimize(self)

    def to(self, *args: Any, **kwargs: Any) -> Decoder:
        # channels_last means nothing to a token decoder, and the 5-D
        # post_quant_conv weight rejects it: ignore the request
        kwargs.pop("memory_format", None)
        return super().to(*args, **kwargs)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Decoder:
        # Casting to a lower dtype keeps the norms and layer scales in float32,
        # as the reference pins them (`_keep_in_fp32_modules`).
        pinned = {
            name: p.data
            for name, p in self.named_parameters()
            if name.endswith(FP32_SUFFIXES) and p.dtype == torch.float32
        }
        super()._apply(fn, recurse)
        for name, p in self.named_parameters():
            if name in pinned and p.dtype != torch.float32:
                p.data = pinned[name].to(p.device)
        self._rope_cache = {}
        return self

    # --- decoding: the reference's tiles and clips over ``forward`` --------
    def decode(self, z: Tensor, **options: Any) -> Tensor:
        if self.image and z.ndim == 4:
            return self._decode_clip(self._check(z.unsqueeze(2)), options).squeeze(2)
        return torch.cat(list(self.iter_decode(z, **options)), dim=2)

    def iter_decode(self, z: Tensor, **options: Any) -> Iterator[Tensor]:
        """Yield ``[B,3,t,H,W]`` frame chunks in order, as each clip is decoded (the image
        variant: one chunk per latent frame).

        ``options``: ``max_batch_tokens`` (tiles batched per ``forward`` call).
        """
        z = self._check(z if z.ndim == 5 else z.unsqueeze(2))
        if self.image:
            for frame in z.split(1, dim=2):
                yield self._decode_clip(frame, options)
            return
        plan = self.plan(z.shape[2])
        if plan.pad_tokens:
            z = torch.cat((z, z[:, :, -1:].expand(-1, -1, plan.pad_tokens, -1, -1)), dim=2)
        left = plan.frames

        def emit(frames: Tensor) -> Tensor:
            nonlocal left
            frames = frames[:, :, :left]
            left -= frames.shape[2]
            return frames.contiguous()

        if plan.single:
            yield emit(self._decode_clip(z, options)[:, :, plan.pre_pad :])
            return
        carry: Tensor | None = None
        cf = plan.chunk_frames
        for start, stop in plan.clips:
            clip = self._decode_clip(z[:, :, start:stop], options)
            with timing.phase("chunk_blend"), torch.no_grad():
                head = clip[:, :, :cf][:, :, plan.pre_pad :]
                if carry is not None:
                    head = crossfade(carry, head, plan.overlap, dim=2)
                carry = clip[:, :, cf : 2 * cf][:, :, plan.pre_pad :] if plan.carries else None
                head = emit(head)
            if head.shape[2]:
                yield head
        if carry is not None and left > 0:
            yield emit(carry)

    def _check(self, z: Tensor) -> Tensor:
        if z.ndim != 5 or z.shape[1] != self.latent_channels or 0 in z.shape:
            raise ValueError(
                f"expected a latent [B,{self.latent_channels},T,H,W] (or [B,C,H,W]), "
                f"got {list(z.shape)}"
            )
        return z.to(self.post_quant_conv.weight.dtype)

    @torch.no_grad()
    def _decode_clip(self, z: Tensor, options: dict[str, Any]) -> Tensor:
        """One temporal clip ``[B,C,t,h,w]``, spatially tiled and blended."""
        r = self.spatial_scale
        height, width = z.shape[-2] * r, z.shape[-1] * r
        ys, yl, yo = split_tiles(height, r)
        xs, xl, xo = split_tiles(width, r)
        th, tw = yl[0] // r, xl[0] // r
        # every tile has the same shape: decode them as one batch of sequences
        subs = [z[..., y // r : y // r + th, x // r : x // r + tw] for y in ys for x in xs]
        out = self._decode_tiles(torch.cat(subs), options)
        grid = out.unflatten(0, (len(ys), len(xs), z.shape[0]))
        tiles = [[grid[i, j] for j in range(len(xs))] for i in range(len(ys))]
        with timing.phase("tile_blend"):
            if len(ys) * len(xs) == 1:
                return tiles[0][0]
            return stitch_tiles(tiles, (ys, xs), (yo, xo), (height, width))

    def _decode_tiles(self, z: Tensor, options: dict[str, Any]) -> Tensor:
        """``[S,C,t,h,w]`` independent tiles -> ``[S,3,t*pt,h*p,w*p]``, in groups."""
        _, _, t, h, w = z.shape
        tokens = t * h * w + self.decoder.register_tokens.shape[1] + 1
        budget = int(options.get("max_batch_tokens") or batch_tokens_for(z.device))
        parts = [self(part) for part in z.split(max(1, budget // tokens))]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
