"""The runner: one decode, from a validated latent to pixels on the host.

de-normalize -> decode (resident weights, the served mode) -> [0, 1] -> uint8 HWC on the
device -> pinned, non-blocking copy to the host. Encoding (PNG, MP4) happens elsewhere, off
the decode worker. HTTP and ``python -m app decode`` both come through here.

Memory: on a GPU, ``rows_that_fit`` plans how many latent rows one decode takes within the free
memory (the scheduler forms micro-batches of at most that many), and a single latent whose
estimate does not fit is decoded tiled. An actual out-of-memory error climbs a ladder: split
the batch, then tile, then (only with ``VAE_OOM_FALLBACK=cpu``) the float32 CPU path, else
``OutOfMemory`` (503 with Retry-After).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from app.decoders.base import VAEDecoder
from app.protocol.request import DecodeRequest, Scaling
from app.runtime import device as devices
from app.runtime.registry import ServedModel
from app.telemetry import timing
from app.telemetry.metrics import Metrics
from app.telemetry.timing import PhaseTimer

log = logging.getLogger("app.runtime.runner")
PLANNING_SHARE = 0.8  # of the free device memory (measured: docs/BENCHMARKS.md, L4 emulation)


class OutOfMemory(Exception):
    """No way of decoding this latent fits the device's memory now (503, Retry-After)."""


class NonFiniteOutput(Exception):
    """The decode produced NaN or infinity: the latent or its factors are out of range."""


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
        budget: int | None = None,
    ) -> None:
        self.metrics = metrics
        # bytes free for one decode, fixed (tests, an emulated card); None: the device's own
        self.budget = budget
        self.oom_fallback = oom_fallback
        self.memory_cap = memory_cap
        self.max_decode_pixels = max_decode_pixels

    # --- whole decodes ------------------------------------------------------------------
    def decode(self, model: ServedModel, request: DecodeRequest, timer: PhaseTimer) -> Tensor:
        """Decode the whole of ``request.latent`` (CPU) in one call into what its ``output``
        asks for; on out-of-memory, the ladder splits, tiles or falls back."""
        return torch.cat(self.decode_rows(model, request, timer))

    def decode_rows(
        self, model: ServedModel, request: DecodeRequest, timer: PhaseTimer
    ) -> list[Tensor]:
        """``decode``, one host tensor per latent row: the decoder's ``[1,3,...]`` for
        ``Output.TENSOR``, else that row's frames ``[t,...]`` (a micro-batch is handed back to
        its requests by rows, whatever a row decodes to)."""
        first = self._first_attempt(model, request.latent, request.options.get("tiled"))
        return self._decode_ladder(model, request.latent, first, request, timer)

    def rows_that_fit(self, model: ServedModel, latent_shape: tuple[int, ...]) -> int:
        """How many latent rows of ``latent_shape`` one decode should take: their estimated
        working memory within the device's budget, and at most ``max_decode_pixels`` output
        pixels (past that, a GPU decode gets slower per pixel: docs/BENCHMARKS.md). The
        scheduler forms micro-batches of at most this many rows; the CPU has no budget."""
        decoder = model.active
        budget = self._budget(decoder)
        if budget is None:
            return 1 << 30
        one = decoder.working_bytes((1, *latent_shape[1:]), _element_size(decoder))
        pixels = latent_shape[-2] * latent_shape[-1] * decoder.spatial_scale**2
        return int(max(1, min(budget // max(one, 1), self.max_decode_pixels // pixels)))

    def _decode_ladder(
        self,
        model: ServedModel,
        latent: Tensor,
        attempt: Attempt,
        request: DecodeRequest,
        timer: PhaseTimer,
    ) -> list[Tensor]:
        try:
            return self._run(attempt, latent, request, timer)
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
            return [
                row
                for part in latent.split(half)
                for row in self._decode_ladder(model, part, attempt, request, timer)
            ]
        nxt = self._next_attempt(model, attempt)
        self._note_retry(model, failed, nxt.label)
        return self._decode_ladder(model, latent, nxt, request, timer)

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
        budget = self.budget
        if budget is None:
            budget = devices.memory_budget(_device_of(decoder), self.memory_cap)
        return None if budget is None else int(budget * PLANNING_SHARE)

    def _next_attempt(self, model: ServedModel, attempt: Attempt) -> Attempt:
        if attempt.decoder.supports_tiling and attempt.tiled is not True:
            decoder = model.decoder_for(True) if attempt.decoder is model.fast else attempt.decoder
            return Attempt(decoder, True, "tiled")
        if self.oom_fallback == "cpu" and attempt.decoder is not model.reference:
            return Attempt(model.reference, None, "cpu")
        raise OutOfMemory("out of device memory decoding this latent, even tiled")

    def _run(
        self, attempt: Attempt, latent: Tensor, request: DecodeRequest, timer: PhaseTimer
    ) -> list[Tensor]:
        decoder, options = attempt.decoder, request.options
        with torch.inference_mode(), timer.active():
            z = self._prepare(decoder, latent, request.scaling, timer)
            if attempt.compiled is not None and not options:
                with timing.phase("decode"):  # one graph: no stage boundaries to time
                    out = attempt.compiled(z)
            else:
                out = decoder.decode(z, **options, **_tiled(decoder, attempt.tiled))
            del z
            rows = self._postprocess(decoder, out, request)
        timer.resolve()
        return rows

    # --- streaming ----------------------------------------------------------------------
    def stream(
        self, model: ServedModel, request: DecodeRequest, timer: PhaseTimer
    ) -> Iterator[Tensor]:
        """The first video in ``request.latent``, chunk by chunk as it is decoded: frames
        ``[t,...]`` (uint8 ``[t,H,W,3]`` for MP4) or, for ``Output.TENSOR``, the decoder's own
        ``[1,3,t,H,W]``. On out-of-memory the decode resumes on the next rung of the ladder,
        skipping the frames already sent (decoding is deterministic)."""
        axis = 0 if request.output.frames else 2  # where a chunk's frames are
        latent = request.latent[:1]
        attempt, sent = self._first_attempt(model, latent, request.options.get("tiled")), 0
        while True:
            skip = sent
            try:
                for chunk in self._stream_on(attempt, latent, request, timer):
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

    def _stream_on(
        self, attempt: Attempt, latent: Tensor, request: DecodeRequest, timer: PhaseTimer
    ) -> Iterator[Tensor]:
        decoder, options = attempt.decoder, request.options
        with torch.inference_mode():
            with timer.active():
                z = self._prepare(decoder, latent, request.scaling, timer)
                chunks = decoder.iter_decode(z, **options, **_tiled(decoder, attempt.tiled))
            while True:
                with timer.active():
                    chunk = next(chunks, None)
                    if chunk is None:
                        return
                    (out,) = self._postprocess(decoder, chunk, request)
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
    def _postprocess(decoder: VAEDecoder, out: Tensor, request: DecodeRequest) -> list[Tensor]:
        """On the device: check, convert to what ``request.output`` asks for; then one copy
        to the host, cut into one tensor per latent row."""
        output, per_row = request.output, 1
        with timing.phase("postprocess"):
            finite = torch.isfinite(out).all()  # read after the download's sync: no extra wait
            if not output.frames:
                x = out.to(request.out_dtype)
            else:
                if out.ndim == 5:  # [B,3,T,H,W] -> [B*T,3,H,W], each row's frames in order
                    per_row = out.shape[2]
                    out = out.transpose(1, 2).flatten(0, 1)
                unit = decoder.to_unit(out.float())
                x = to_uint8_hwc(unit) if output.uint8 else unit.to(request.out_dtype)
        with timing.phase("download"):
            host = _download(x)
        if not bool(finite):
            raise NonFiniteOutput(
                "the decoded output is not finite (NaN or infinity): the latent or its "
                "scaling_factor/shift_factor are out of the decoder's range"
            )
        return list(host.split(per_row))

    def _note_retry(self, model: ServedModel, failed: str, rung: str) -> None:
        log.warning(
            "model %s: out of memory on the %s decode, retrying %s", model.name, failed, rung
        )
        self.metrics.retries_total.labels(model.name, "oom", rung).inc()


def to_uint8_hwc(unit: Tensor) -> Tensor:
    """[N,3,H,W] in [0,1] -> uint8 [N,H,W,3], rounded as diffusers' postprocess does."""
    return (unit.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)


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
