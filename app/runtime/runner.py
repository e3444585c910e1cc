"""The runner: one decode, from a validated latent to pixels on the host.

de-normalize -> decode (resident weights, the served mode) -> [0, 1] -> uint8 HWC on the
device -> pinned, non-blocking copy to the host. Encoding (PNG, MP4) happens elsewhere, off
the decode worker. HTTP and ``python -m app decode`` both come through here.

Memory: before a decode on a GPU, its working memory is estimated from the decoder's geometry
and checked against what the device has free; a micro-batch that does not fit is split, a
single latent that does not fit is decoded tiled. The same ladder answers an actual
out-of-memory error: split the batch, then tile, then (only with ``VAE_OOM_FALLBACK=cpu``) the
float32 CPU path, else ``OutOfMemory`` (503 with Retry-After).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from app import timing
from app.decoders.base import VAEDecoder
from app.metrics import Metrics
from app.runtime import device as devices
from app.runtime.registry import ServedModel
from app.timing import PhaseTimer

log = logging.getLogger("app.runtime.runner")
PLANNING_SHARE = 0.8  # of the free device memory (measured: docs/BENCHMARKS.md, L4 emulation)


class Want(enum.Enum):
    """What the caller needs of a decode."""

    RAW = "raw"  # the decoder's own output space, in the request's dtype (output_type=pt)
    UNIT = "unit"  # RGB in [0, 1], frames [N,3,H,W] (remote_decode's processor path)
    UINT8 = "uint8"  # uint8 frames [N,H,W,3]: images, MP4, partial_postprocess


class OutOfMemory(Exception):
    """No way of decoding this latent fits the device's memory now (503, Retry-After)."""


class NonFiniteOutput(Exception):
    """The decode produced NaN or infinity: the latent or its factors are out of range."""


@dataclass
class Scaling:
    """How the latent is de-normalized before decoding (remote_decode's semantics)."""

    scaling_factor: float | None = None
    shift_factor: float | None = None
    model_default: bool = False  # do_scaling=true without factors

    def apply(self, decoder: VAEDecoder, z: Tensor) -> Tensor:
        if self.scaling_factor is not None or self.shift_factor is not None:
            return z / (self.scaling_factor or 1.0) + (self.shift_factor or 0.0)
        return decoder.denormalize(z) if self.model_default else z


@dataclass
class Attempt:
    """One rung of the ladder: which decoder, tiled or not (or its compiled graph)."""

    decoder: VAEDecoder
    tiled: bool | None
    label: str
    compiled: Callable[[Tensor], Tensor] | None = None


class Runner:
    def __init__(
        self,
        metrics: Metrics,
        oom_fallback: str = "off",
        memory_cap: int = 0,
        max_decode_pixels: int = 4 << 20,
    ) -> None:
        self.metrics = metrics
        self.oom_fallback = oom_fallback
        self.memory_cap = memory_cap
        self.max_decode_pixels = max_decode_pixels

    # --- whole decodes ------------------------------------------------------------------
    def decode(
        self,
        model: ServedModel,
        latent: Tensor,
        scaling: Scaling,
        options: dict[str, Any],
        want: Want,
        timer: PhaseTimer,
        out_dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        """Decode ``latent`` ([B,C,H,W] or [B,C,T,H,W], CPU) into what ``want`` asks for."""
        outs = []
        for piece in self.split_for_budget(model, latent):
            first = self._first_attempt(model, piece, options.get("tiled"))
            args = (scaling, options, want, timer, out_dtype)
            outs.append(self._decode_ladder(model, piece, first, *args))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode_ladder(self, model, latent, attempt, scaling, options, want, timer, out_dtype):
        try:
            return self._run(attempt, latent, scaling, options, want, timer, out_dtype)
        except Exception as exc:
            if not devices.is_oom(exc):
                raise
            failed = attempt.label
        # out of the except block: its traceback no longer pins the failed decode's tensors
        devices.release_cached(model.device)
        if latent.shape[0] > 1:
            self._note_retry(model, failed, "split")
            half = (latent.shape[0] + 1) // 2
            attempt = replace(attempt, compiled=None)  # a graph is compiled for one shape
            parts = [
                self._decode_ladder(model, part, attempt, scaling, options, want, timer, out_dtype)
                for part in latent.split(half)
            ]
            return torch.cat(parts)
        nxt = self._next_attempt(model, attempt)
        self._note_retry(model, failed, nxt.label)
        return self._decode_ladder(model, latent, nxt, scaling, options, want, timer, out_dtype)

    def _first_attempt(
        self, model: ServedModel, latent: Tensor, asked: bool | None = None
    ) -> Attempt:
        """The served decoder, untiled on a GPU when the estimate fits the free memory.
        ``asked``: the caller's own ``tiled`` option (then it decides)."""
        decoder, graph = model.active, model.compiled.get(tuple(latent.shape))
        if asked is not None:
            return Attempt(model.decoder_for(asked), None, "served")
        budget = self._budget(decoder)
        if budget is None:  # CPU: the family's own default, where the gate checked its tiles
            untiled = decoder.supports_tiling and decoder is not model.decoder_for(True)
            return Attempt(decoder, False if untiled else None, "served", graph)
        one = decoder.working_bytes(tuple(latent[:1].shape), _element_size(decoder))
        if one <= budget:
            return Attempt(decoder, False, "served", graph)
        if decoder.supports_tiling:
            return Attempt(model.decoder_for(True), True, "tiled")
        raise OutOfMemory(
            f"decoding this latent needs about {one / 2**30:.1f} GiB of device memory; "
            f"{budget / 2**30:.1f} GiB is free"
        )

    def _budget(self, decoder: VAEDecoder) -> int | None:
        """The share of free device memory a decode is planned into: near the limit the
        caching allocator has to free and retry, which costs more than a split."""
        budget = devices.memory_budget(_device_of(decoder), self.memory_cap)
        return None if budget is None else int(budget * PLANNING_SHARE)

    def _next_attempt(self, model: ServedModel, attempt: Attempt) -> Attempt:
        if attempt.decoder.supports_tiling and attempt.tiled is not True:
            decoder = model.decoder_for(True) if attempt.decoder is model.fast else attempt.decoder
            return Attempt(decoder, True, "tiled")
        if self.oom_fallback == "cpu" and attempt.decoder is not model.reference:
            return Attempt(model.reference, None, "cpu")
        raise OutOfMemory("out of device memory decoding this latent, even tiled")

    def split_for_budget(self, model: ServedModel, latent: Tensor) -> list[Tensor]:
        """A micro-batch cut into pieces whose estimated working memory fits the device, and
        of at most ``max_decode_pixels`` output pixels each (past that, a GPU decode gets
        slower per pixel: docs/BENCHMARKS.md)."""
        decoder = model.active
        budget = self._budget(decoder)
        if budget is None or latent.shape[0] == 1:
            return [latent]
        one = decoder.working_bytes(tuple(latent[:1].shape), _element_size(decoder))
        pixels = latent.shape[-2] * latent.shape[-1] * decoder.spatial_scale**2
        per_piece = min(budget // max(one, 1), self.max_decode_pixels // pixels)
        return list(latent.split(int(max(1, per_piece))))

    def _run(
        self,
        attempt: Attempt,
        latent: Tensor,
        scaling: Scaling,
        options: dict[str, Any],
        want: Want,
        timer: PhaseTimer,
        out_dtype: torch.dtype,
    ) -> Tensor:
        decoder = attempt.decoder
        with torch.inference_mode(), timer.active():
            z = self._prepare(decoder, latent, scaling, timer)
            if attempt.compiled is not None and not options:
                with timing.phase("decode"):  # one graph: no stage boundaries to time
                    out = attempt.compiled(z)
            else:
                out = decoder.decode(z, **options, **_tiled(decoder, attempt.tiled))
            del z
            host = self._postprocess(decoder, out, want, out_dtype, video=latent.ndim == 5)
        timer.resolve()
        return host

    # --- streaming ----------------------------------------------------------------------
    def stream(
        self,
        model: ServedModel,
        latent: Tensor,
        scaling: Scaling,
        options: dict[str, Any],
        timer: PhaseTimer,
        want: Want = Want.UINT8,
        out_dtype: torch.dtype = torch.uint8,
    ) -> Iterator[Tensor]:
        """The first video in ``latent``, chunk by chunk as it is decoded: uint8 frames
        ``[t,H,W,3]`` (``Want.UINT8``) or the decoder's own ``[1,3,t,H,W]`` (``Want.RAW``).
        On out-of-memory the decode resumes on the next rung of the ladder, skipping the
        frames already sent (decoding is deterministic)."""
        axis = 0 if want is Want.UINT8 else 2  # where a chunk's frames are
        attempt, sent = self._first_attempt(model, latent[:1], options.get("tiled")), 0
        while True:
            skip = sent
            try:
                chunks = self._stream_on(
                    attempt, latent[:1], scaling, options, timer, want, out_dtype
                )
                for chunk in chunks:
                    frames = chunk.shape[axis]
                    chunk, skip = (
                        chunk.narrow(axis, min(skip, frames), frames - min(skip, frames)),
                        max(0, skip - frames),
                    )
                    if chunk.shape[axis]:
                        sent += chunk.shape[axis]
                        yield chunk
                return
            except Exception as exc:
                if not devices.is_oom(exc):
                    raise
                failed = attempt.label
            devices.release_cached(model.device)
            attempt = self._next_attempt(model, attempt)
            self._note_retry(model, failed, attempt.label)

    def _stream_on(self, attempt, latent, scaling, options, timer, want, out_dtype):
        decoder = attempt.decoder
        with torch.inference_mode():
            with timer.active():
                z = self._prepare(decoder, latent, scaling, timer)
                chunks = decoder.iter_decode(z, **options, **_tiled(decoder, attempt.tiled))
            while True:
                with timer.active():
                    chunk = next(chunks, None)
                    if chunk is None:
                        return
                    out = self._postprocess(decoder, chunk, want, out_dtype, True)
                timer.resolve()
                yield out

    # --- steps --------------------------------------------------------------------------
    @staticmethod
    def _prepare(decoder: VAEDecoder, latent: Tensor, scaling: Scaling, timer: PhaseTimer):
        """Upload to the decoder's device and de-normalize (in float32)."""
        timer.device = _device_of(decoder)
        with timer.device_phase("upload"):
            z = latent.to(timer.device, non_blocking=True)
        with timer.device_phase("denormalize"):
            return scaling.apply(decoder, z.float())

    @staticmethod
    def _postprocess(
        decoder: VAEDecoder, out: Tensor, want: Want, out_dtype: torch.dtype, video: bool
    ) -> Tensor:
        """On the device: check, convert to what is wanted; then one copy to the host."""
        with timing.phase("postprocess"):
            finite = torch.isfinite(out).all()  # read after the download's sync: no extra wait
            if want is Want.RAW:
                x = out.to(out_dtype)
            else:
                frames = _frames(decoder.to_unit(out.float()), video)
                x = frames.to(out_dtype) if want is Want.UNIT else to_uint8_hwc(frames)
        with timing.phase("download"):
            host = _download(x)
        if not bool(finite):
            raise NonFiniteOutput(
                "the decoded output is not finite (NaN or infinity): the latent or its "
                "scaling_factor/shift_factor are out of the decoder's range"
            )
        return host

    def _note_retry(self, model: ServedModel, failed: str, rung: str) -> None:
        log.warning(
            "model %s: out of memory on the %s decode, retrying %s", model.name, failed, rung
        )
        self.metrics.retries_total.labels(model.name, "oom", rung).inc()


def to_uint8_hwc(unit: Tensor) -> Tensor:
    """[N,3,H,W] in [0,1] -> uint8 [N,H,W,3], rounded as diffusers' postprocess does."""
    return (unit.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)


def _frames(unit: Tensor, video: bool) -> Tensor:
    """[B,3,H,W] stays; video [B,3,T,H,W] -> [B*T,3,H,W] frames in order."""
    if not video:
        return unit
    return unit.permute(0, 2, 1, 3, 4).reshape(-1, unit.shape[1], *unit.shape[3:])


def _download(x: Tensor) -> Tensor:
    """To the host: contiguous, through pinned memory without a blocking copy on a GPU."""
    x = x.contiguous()
    if x.device.type != "cuda":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    torch.cuda.current_stream(x.device).synchronize()
    return host


def _tiled(decoder: VAEDecoder, tiled: bool | None) -> dict[str, Any]:
    return {"tiled": tiled} if decoder.supports_tiling and tiled is not None else {}


def _device_of(decoder: VAEDecoder) -> torch.device:
    return next(decoder.parameters()).device


def _element_size(decoder: VAEDecoder) -> int:
    return next(decoder.parameters()).element_size()
