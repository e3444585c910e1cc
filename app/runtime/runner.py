"""The runner: one run of a served part, decoder or encoder, on the host's input.

A decode: de-normalize -> decode (resident weights, the served mode) -> [0, 1] -> uint8 HWC on
the device -> pinned, non-blocking copy to the host. An encode: pixels up -> moments (chunk by
chunk for a video) -> the mean or a seeded sample -> scaling and layout -> the latent down.
Writing the answer (PNG, MP4, tensor bytes) happens elsewhere, off the worker. HTTP and
``python -m app decode`` / ``encode`` all come through here.

Memory: ``rows_that_fit`` plans how many rows one run takes (the scheduler forms micro-batches
of at most that many) within ``max_planned_bytes`` (``VAE_MAX_DECODE_MB``, the 413's limit per
request: requests batched together plan no more than one may) and within the free memory (the
device's; on the CPU what the host, its cgroup, has available); a single latent whose plan does
not fit is decoded tiled, else refused: ``TooLarge`` (413) where it would not fit the device
holding nothing but the part's weights, else ``OutOfMemory`` (503: it may fit later). An actual
out-of-memory error climbs one ladder for both directions: split the batch, then tile (where
the part tiles), then (only with ``VAE_OOM_FALLBACK=cpu``) the float32 CPU path, else
``OutOfMemory`` (503 with Retry-After).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from app.families.decoder import VAEDecoder
from app.families.encoder import VAEEncoder
from app.protocol.request import DecodeRequest, EncodeRequest, EncodeScaling, Scaling
from app.protocol.shapes import mib
from app.runtime import device as devices
from app.runtime.parts import ServedPart
from app.runtime.selection import ENCODER_STAGE_PREFIX
from app.telemetry import timing
from app.telemetry.metrics import Metrics
from app.telemetry.timing import PhaseTimer

Request = DecodeRequest | EncodeRequest

log = logging.getLogger("app.runtime.runner")
PLANNING_SHARE = 0.8  # of the free device memory (measured: docs/BENCHMARKS.md, L4 emulation)


class OutOfMemory(Exception):
    """No way of decoding this latent fits the device's memory now (503, Retry-After)."""


class NoRoomNow(OutOfMemory):
    """Refused by the plan, before running: the memory free now is too little (load, not a
    fault: logged as a warning)."""


class TooLarge(Exception):
    """This run cannot fit the device's memory even with nothing else resident (413)."""


class NonFiniteOutput(Exception):
    """The run produced NaN or infinity: the input or its factors are out of range."""


class InvalidInput(ValueError):
    """The encoder refused the pixels (a shape its family cannot encode): a 422."""


@dataclass
class Attempt:
    """One rung of the ladder: which module, tiled or not (or its compiled graph)."""

    decoder: nn.Module
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
        max_planned_bytes: int = 16 << 30,
    ) -> None:
        self.metrics = metrics
        # bytes free for one decode, fixed (tests, an emulated card); None: the device's own
        self.budget = budget
        self.oom_fallback = oom_fallback
        self.memory_cap = memory_cap
        self.max_decode_pixels = max_decode_pixels
        self.max_planned_bytes = max_planned_bytes  # one run's planned memory, any device
        # what stays resident on a device whatever runs (the runtime's: every served part's
        # weights, the process itself); None: a part's own weights only
        self.resident: Callable[[torch.device], int] | None = None

    # --- the scheduler's calls: rows, chunks, and what chunks add up to -------------------
    def rows(self, part: ServedPart, request: Request, timer: PhaseTimer) -> list[Tensor]:
        """The whole of one request's (or micro-batch's) input, one host tensor per row."""
        if isinstance(request, EncodeRequest):
            return self.encode_rows(part, request, timer)
        return self.decode_rows(part, request, timer)

    def chunks(self, part: ServedPart, request: Request, timer: PhaseTimer) -> Iterator[Tensor]:
        """One video request chunk by chunk: a decode's frames as they are decoded, an
        encode's moments (``assemble`` makes the latent of them)."""
        if isinstance(request, EncodeRequest):
            return self.encode_chunks(part, request, timer)
        return self.stream(part, request, timer)

    def assemble(
        self, part: ServedPart, request: Request, chunks: list[Tensor], timer: PhaseTimer
    ) -> Tensor:
        """What a chunked request's chunks add up to: the video, or the encode's latent."""
        if isinstance(request, EncodeRequest):
            return self.encode_finish(part, request, torch.cat(chunks, 2), timer)
        axis = 0 if request.output.frames else 2
        return torch.cat(chunks, axis)

    # --- whole decodes ------------------------------------------------------------------
    def decode(self, model: ServedPart, request: DecodeRequest, timer: PhaseTimer) -> Tensor:
        """Decode the whole of ``request.latent`` (CPU) in one call into what its ``output``
        asks for; on out-of-memory, the ladder splits, tiles or falls back."""
        return torch.cat(self.decode_rows(model, request, timer))

    def decode_rows(
        self, model: ServedPart, request: DecodeRequest, timer: PhaseTimer
    ) -> list[Tensor]:
        """``decode``, one host tensor per latent row: the decoder's ``[1,3,...]`` for
        ``Output.TENSOR``, else that row's frames ``[t,...]`` (a micro-batch is handed back to
        its requests by rows, whatever a row decodes to)."""
        first = self._first_attempt(model, request.latent, request.options.get("tiled"))
        run = lambda attempt, latent: self._run(attempt, latent, request, timer)  # noqa: E731
        return self._ladder(model, request.latent, first, run)

    def rows_that_fit(self, part: ServedPart, shape: tuple[int, ...]) -> int:
        """How many rows of ``shape`` one run should take: their planned memory within
        ``max_planned_bytes`` (rows batched together plan no more than one request may) and
        within the device's budget (the free GPU memory, the host's on the CPU); on a GPU at
        most ``max_decode_pixels`` output pixels too (past that, a GPU decode gets slower per
        pixel: docs/BENCHMARKS.md). The scheduler forms micro-batches of at most this many."""
        module = part.active
        one = _planned(module, (1, *shape[1:]))
        rows = min(self.max_planned_bytes, self._budget(module)) // max(one, 1)
        if _device_of(module).type != "cpu":
            scale = 1 if isinstance(module, VAEEncoder) else module.spatial_scale
            rows = min(rows, self.max_decode_pixels // (shape[-2] * shape[-1] * scale**2))
        return int(max(1, rows))

    # --- encodes ------------------------------------------------------------------------
    def encode_rows(
        self, part: ServedPart, request: EncodeRequest, timer: PhaseTimer
    ) -> list[Tensor]:
        """Encode every row of ``request.pixels``: one latent per row, on the host."""
        pixels = request.pixels
        first = self._first_attempt(part, pixels)

        def run(attempt: Attempt, x: Tensor) -> list[Tensor]:
            chunks = list(self._moments(attempt, x, timer))
            return list(self.encode_finish(part, request, torch.cat(chunks, 2), timer).split(1))

        return self._ladder(part, pixels, first, run)

    def encode_chunks(
        self, part: ServedPart, request: EncodeRequest, timer: PhaseTimer
    ) -> Iterator[Tensor]:
        """A video's moments chunk by chunk (its clip read window by window), on the host; on
        out-of-memory the encode restarts on the next rung (it holds no frames sent out)."""
        attempt = self._first_attempt(part, request.pixels)
        while True:
            done: list[Tensor] = []
            try:
                for chunk in self._moments(attempt, request.pixels, timer):
                    done.append(chunk)
                    yield chunk
                return
            except Exception as exc:
                if not devices.is_oom(exc) or done:
                    raise
                failed = attempt.label
            devices.release_cached(part.device)
            attempt = self._next_attempt(part, attempt)
            self._note_retry(part, failed, attempt.label)

    def _moments(self, attempt: Attempt, x: Any, timer: PhaseTimer) -> Iterator[Tensor]:
        """The attempt's encoder's moments of ``x`` (pixels, or a clip read as it goes), chunk
        by chunk (tiled as the attempt says), each on the host."""
        encoder = attempt.decoder
        device = _device_of(encoder)
        timer.device = device
        if isinstance(x, Tensor):
            with timer.active(), timer.device_phase("upload"):
                x = x.to(device, _dtype_of(encoder))
        x = _on_device(x, encoder) if not isinstance(x, Tensor) else x
        chunks = encoder.iter_moments(x, **_tiled(encoder, attempt.tiled))
        while True:
            with torch.inference_mode(), timer.active():
                try:
                    chunk = next(chunks, None)
                except ValueError as exc:  # the family's input checks run before any compute
                    raise InvalidInput(str(exc)) from None
                if chunk is None:
                    return
                with timer.device_phase("download"):
                    chunk = chunk.float().cpu()
            timer.resolve()
            yield chunk

    @torch.inference_mode()
    def encode_finish(
        self, part: ServedPart, request: EncodeRequest, moments: Tensor, timer: PhaseTimer
    ) -> Tensor:
        """Moments -> the latent a client receives: the mean or a seeded sample, then
        ``(z - shift) * scale`` (or the model's own normalisation), then FLUX's packing."""
        encoder = part.reference  # the normalisation reads float32 statistics
        with timer.active(), timer.phase(ENCODER_STAGE_PREFIX + "normalize"):
            generator = torch.Generator().manual_seed(request.seed) if request.sample else None
            z = encoder.latent(moments, request.sample, generator)
            z = scaled(encoder, z, request.scaling)
            if request.packed:
                z = pack_latents(z)
        if not bool(torch.isfinite(z).all()):
            raise NonFiniteOutput(
                "the encode produced NaN or infinity: pixels far outside [-1, 1], or factors"
            )
        return z.contiguous()

    # --- the ladder ---------------------------------------------------------------------
    def _ladder(
        self,
        part: ServedPart,
        x: Tensor,
        attempt: Attempt,
        run: Callable[[Attempt, Tensor], list[Tensor]],
    ) -> list[Tensor]:
        """``run(attempt, x)``; on out-of-memory, the same on halves of the batch, then on the
        next rung (tiled, then the CPU)."""
        try:
            return run(attempt, x)
        except Exception as exc:
            if not devices.is_oom(exc):
                raise
            failed = attempt.label
        # out of the except block: its traceback no longer pins the failed run's tensors
        devices.release_cached(part.device)
        if x.shape[0] > 1:
            self._note_retry(part, failed, "split")
            half = (x.shape[0] + 1) // 2
            attempt = replace(attempt, compiled=None)  # a graph is compiled for one shape
            return [
                row for piece in x.split(half) for row in self._ladder(part, piece, attempt, run)
            ]
        nxt = self._next_attempt(part, attempt)
        self._note_retry(part, failed, nxt.label)
        return self._ladder(part, x, nxt, run)

    def _first_attempt(self, part: ServedPart, x: Any, asked: bool | None = None) -> Attempt:
        """The served module when its planned memory fits the budget and, where it tiles,
        ``max_planned_bytes`` (on a GPU untiled; on the CPU the family's own default, where the
        gate checked its tiles), else tiled, else ``TooLarge`` (it never fits) or
        ``OutOfMemory`` (not now). ``asked``: the caller's own ``tiled`` option (then it
        decides)."""
        module, graph = part.active, part.compiled.get(tuple(x.shape))
        tiles = getattr(module, "supports_tiling", False)
        if asked is not None:
            return Attempt(part.decoder_for(asked), None, "served")
        budget, one = self._budget(module), _planned(module, (1, *x.shape[1:]))
        on_cpu = _device_of(module).type == "cpu"
        if tiles:  # tiled where the untiled plan exceeds what one request may plan (the 413's)
            budget = min(budget, self.max_planned_bytes)
        if one <= budget:
            untiled = tiles and (not on_cpu or module is not part.decoder_for(True))
            return Attempt(module, False if untiled else None, "served", graph)
        if tiles:
            return Attempt(part.decoder_for(True), True, "tiled")
        where = "host" if on_cpu else "device"
        memory = f"this {part.part} run needs about {mib(one)} of {where} memory"
        capacity = self._capacity(module)
        if one > capacity:
            raise TooLarge(f"{memory}; the {where} has at most {mib(capacity)} for one run")
        raise NoRoomNow(f"{memory}; {mib(budget)} is free to plan into now")

    def _budget(self, module: nn.Module) -> int:
        """The share of the free memory (the device's; the host's on the CPU) one run is
        planned into: near the limit a caching allocator has to free and retry, which costs
        more than a split, and a CPU process keeps more resident than it plans."""
        budget = self.budget
        if budget is None:
            budget = devices.memory_budget(_device_of(module), self.memory_cap)
        return int(budget * PLANNING_SHARE)

    def capacity(self, part: ServedPart) -> int | None:
        """The most one run of ``part`` could ever plan here where it cannot tile (more is
        ``TooLarge``); None where it tiles (any size runs, in tiles)."""
        module = part.active
        return None if getattr(module, "supports_tiling", False) else self._capacity(module)

    def _capacity(self, module: nn.Module) -> int:
        """The share of the device's whole memory (the host's on the CPU) less what stays
        resident there whatever runs: what one run could plan into once every other run and
        request is done, the most any budget can be (on the CPU at least the budget now: the
        memory-mapped weights of parts not run yet are not resident)."""
        if self.budget is not None:
            return int(self.budget * PLANNING_SHARE)
        device = _device_of(module)
        # the runtime's count holds every served copy's weights: no walk of this one's
        held = self.resident(device) if self.resident else weight_bytes(module, device)
        total = devices.memory_capacity(device, self.memory_cap)
        capacity = max(0, int((total - held) * PLANNING_SHARE))
        if device.type == "cpu":  # mapped weights are resident once read: what fits now fits
            capacity = max(capacity, self._budget(module))
        return capacity

    def _next_attempt(self, part: ServedPart, attempt: Attempt) -> Attempt:
        if getattr(attempt.decoder, "supports_tiling", False) and attempt.tiled is not True:
            module = part.decoder_for(True) if attempt.decoder is part.fast else attempt.decoder
            return Attempt(module, True, "tiled")
        if self.oom_fallback == "cpu" and attempt.decoder is not part.reference:
            return Attempt(part.reference, None, "cpu")
        raise OutOfMemory(f"out of device memory in this {part.part} run, even tiled")

    def _run(
        self, attempt: Attempt, latent: Tensor, request: DecodeRequest, timer: PhaseTimer
    ) -> list[Tensor]:
        """One decode of ``latent`` on the attempt's rung."""
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
        self, model: ServedPart, request: DecodeRequest, timer: PhaseTimer
    ) -> Iterator[Tensor]:
        """Every video in ``request.latent``, one row after another, chunk by chunk as it is
        decoded: frames ``[t,...]`` (uint8 ``[t,H,W,3]`` for MP4) or, for ``Output.TENSOR``,
        the decoder's own ``[1,3,t,H,W]``; a chunk never spans two rows. On out-of-memory a
        row's decode resumes on the next rung of the ladder, skipping the frames already
        sent (decoding is deterministic)."""
        for row in range(request.latent.shape[0]):
            yield from self._stream_row(model, request, request.latent[row : row + 1], timer)

    def _stream_row(
        self, model: ServedPart, request: DecodeRequest, latent: Tensor, timer: PhaseTimer
    ) -> Iterator[Tensor]:
        axis = 0 if request.output.frames else 2  # where a chunk's frames are
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

    def _note_retry(self, part: ServedPart, failed: str, rung: str) -> None:
        log.warning(
            "model %s: out of memory on the %s %s run, retrying %s",
            part.name,
            failed,
            part.part,
            rung,
        )
        self.metrics.retries_total.labels(part.name, "oom", rung).inc()


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


def _tiled(part: VAEDecoder | VAEEncoder, tiled: bool | None) -> dict[str, Any]:
    return {"tiled": tiled} if part.supports_tiling and tiled is not None else {}


def weight_bytes(module: nn.Module, device: torch.device) -> int:
    """The bytes of ``module``'s weights and buffers that are on ``device``'s kind."""
    return sum(t.nbytes for t in module.state_dict().values() if t.device.type == device.type)


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _dtype_of(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def _element_size(module: nn.Module) -> int:
    return next(module.parameters()).element_size()


def _planned(module: Any, shape: tuple[int, ...]) -> int:
    """What one run of ``module`` on an input of ``shape`` is planned to hold (the 413's
    estimate: on the CPU the decoders' margin included)."""
    return module.planned_bytes(shape, _element_size(module))


class _DeviceClip:
    """A host clip whose windows go up to the encoder's device and dtype as they are read."""

    def __init__(self, clip: Any, module: nn.Module) -> None:
        self.clip, self.device, self.dtype = clip, _device_of(module), _dtype_of(module)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.clip.shape

    def window(self, start: int, stop: int) -> Tensor:
        with timing.phase("upload"):
            return self.clip.window(start, stop).to(self.device, self.dtype)

    def release(self, before: int) -> None:
        self.clip.release(before)

    def close(self) -> None:
        self.clip.close()


def _on_device(clip: Any, module: nn.Module) -> _DeviceClip:
    return _DeviceClip(clip, module)


def scaled(encoder: VAEEncoder, z: Tensor, scaling: EncodeScaling) -> Tensor:
    """remote_encode's ``(z - shift) * scale``, or the model's own with ``do_scaling``."""
    if scaling.scaling_factor is not None or scaling.shift_factor is not None:
        scale = 1.0 if scaling.scaling_factor is None else scaling.scaling_factor
        return (z - (scaling.shift_factor or 0.0)) * scale
    return encoder.normalize(z) if scaling.model_default else z


def pack_latents(z: Tensor) -> Tensor:
    """FLUX's packed layout (``FluxPipeline._pack_latents``): ``[B,C,H,W]`` ->
    ``[B, (H/2)(W/2), 4C]``, each 2x2 patch's channels together."""
    b, c, h, w = z.shape
    z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return z.reshape(b, (h // 2) * (w // 2), c * 4)
