"""The decode engine: resident models, one bounded queue, one worker thread per device.

The event loop never runs a decode: handlers ``submit`` a ``Job`` and await its future.
The worker takes jobs in order and micro-batches consecutive ones of the same model,
latent shape and options into one decode.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from app import fastpath
from app.config import Settings
from app.decoders.base import VAEDecoder
from app.metrics import Metrics
from app.protocol import Limits, ModelGeometry
from app.store import Manifest, list_models, load_model
from app.timing import PhaseTimer

log = logging.getLogger("app.engine")


class QueueFull(Exception):
    """The bounded queue is full: the caller answers 429 with Retry-After."""


class Stopped(Exception):
    """The engine is shutting down: the caller answers 503 with Retry-After."""


class DeadlineExceeded(Exception):
    """The job's deadline passed before a worker could start it: it is refused, not decoded."""

    def __init__(self, waited: float) -> None:
        super().__init__(f"the request's deadline passed after {waited:.2f} s in the queue")
        self.waited = waited


# Decode options that make a family decode in tiles, for the out-of-memory retry; a decoder
# class may also declare its own as ``tiled_retry_options``.
TILED_RETRY: dict[str, dict[str, Any]] = {"ltx": {"tile": True}}


@dataclass
class ServedModel:
    name: str
    manifest: Manifest
    reference: VAEDecoder  # float32 CPU: the source of truth and the fallback
    fast: VAEDecoder
    device: torch.device
    dtype: torch.dtype
    parity_cosine: float
    fallback: bool
    reason: str = ""
    load_seconds: float = 0.0

    @property
    def active(self) -> VAEDecoder:
        return self.reference if self.fallback else self.fast

    @property
    def serving_device(self) -> str:
        return "cpu" if self.fallback else self.device.type

    def limits(self, server: Limits) -> Limits:
        """The server's limits, tightened by the manifest config's own (if it sets any)."""
        return server.tightened(self.manifest.config)

    @property
    def geometry(self) -> ModelGeometry:
        d = self.reference
        return ModelGeometry(
            d.latent_channels, d.spatial_scale, d.temporal_scale, d.is_video, d.frames_out
        )

    def describe(self) -> dict[str, Any]:
        serving_dtype = torch.float32 if self.fallback else self.dtype
        return {
            "name": self.name,
            "family": self.manifest.family,
            "config": self.reference.summary(),
            "source": self.manifest.source,
            "store_dtype": self.manifest.dtype,
            "device": self.serving_device,
            "dtype": str(serving_dtype).removeprefix("torch."),
            # "exact": the float32 CPU reference itself; "optimized": the gated fast copy
            "path": "exact" if self.active is self.reference else "optimized",
            "parity_cosine": self.parity_cosine,
            "fallback": self.fallback,
            "fallback_reason": self.reason or None,
            "load_seconds": round(self.load_seconds, 3),
        }


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
class Job:
    model: ServedModel
    latent: Tensor  # [B,C,H,W] or [B,C,T,H,W], float32 CPU
    scaling: Scaling
    options: dict[str, Any]
    timer: PhaseTimer
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)
    deadline: float | None = None  # perf_counter time by which the job must have started
    # Streaming (MP4): chunks in [0, 1] are put here as they are decoded, then None; the
    # bound keeps a slow encoder from letting decoded frames pile up. ``first`` resolves
    # once the first chunk is out (or with the error that came before it), so the handler
    # can still answer an error as JSON before it commits to a 200.
    stream: queue.Queue | None = None
    first: Future = field(default_factory=Future)
    abandoned: threading.Event = field(default_factory=threading.Event)  # the reader went away
    stall_s: float = 60.0  # a stream reader that takes no chunk for this long is dropped

    def abandon(self) -> None:
        """The caller went away: drop the job if it is still queued, stop it if it streams."""
        self.abandoned.set()
        self.future.cancel()

    def batch_key(self) -> tuple:
        opts = tuple(sorted(self.options.items()))
        return (
            self.model.name,
            tuple(self.latent.shape[1:]),
            tuple(vars(self.scaling).items()),
            opts,
        )


class Engine:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.models: dict[str, ServedModel] = {}
        self.errors: dict[str, str] = {}  # model -> why it is not served
        self.loading = True
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=settings.queue_depth)
        self._worker: threading.Thread | None = None
        self._pending: Job | None = None  # a job taken off the queue that did not batch
        self._stopping = False

    # --- loading -----------------------------------------------------------
    def load_all(self) -> None:
        """Load every configured store entry and run its gate (a failing one is reported)."""
        try:
            self._load_all()
        finally:
            self.loading = False

    def _load_all(self) -> None:
        store = Path(self.settings.models_dir)
        names = self.settings.model_names() or list_models(store)
        if not names:
            self.errors["*"] = f"no models in the store {store} (run `python -m app bake`)"
        try:
            device = fastpath.resolve_device(self.settings.device)
        except RuntimeError as exc:
            self.errors["*"] = str(exc)
            log.error("no model served: %s", exc)
            names = []
        for name in names:
            try:
                self.models[name] = self._load_one(store, name, device)
                self.errors.pop(name, None)
            except Exception as exc:  # one broken entry is reported; the others still load
                self.errors[name] = str(exc)
                log.error("model %s not served: %s", name, exc)

    def _load_one(self, store: Path, name: str, device: torch.device) -> ServedModel:
        t0 = time.perf_counter()
        manifest, decoder = load_model(store, name, verify=self.settings.verify_weights)
        reference = decoder.float() if _has_non_float32(decoder) else decoder
        fast, dtype, gate = reference, torch.float32, fastpath.GateResult(1.0, True)
        for path in fastpath.candidate_paths(self.settings.dtype, device):
            fast, dtype = fastpath.make_fast(reference, device, path), path.dtype
            gate = fastpath.parity_gate(fast, reference, self.settings.parity_min_cos)
            log.info("model %s: %s %s parity cosine %.7f", name, device, path, gate.cosine)
            if gate.passed:
                break
        self.metrics.parity_cosine.labels(name).set(gate.cosine)  # a failing gate's too
        reason = ""
        if not gate.passed:
            reason = (
                f"parity cosine {gate.cosine:.6f} < {self.settings.parity_min_cos} on "
                f"{device.type}/{str(dtype).removeprefix('torch.')}"
            )
            if self.settings.fallback == "off":
                raise RuntimeError(f"{name}: {reason} and VAE_FALLBACK=off")
            log.warning("model %s served on the float32 CPU fallback: %s", name, reason)
        served = ServedModel(
            name,
            manifest,
            reference,
            fast,
            device,
            dtype,
            gate.cosine,
            fallback=not gate.passed,
            reason=reason,
            load_seconds=time.perf_counter() - t0,
        )
        self.metrics.fallback_active.labels(name).set(int(served.fallback))
        self.metrics.model_load_seconds.labels(name).set(served.load_seconds)
        return served

    @property
    def ready(self) -> bool:
        """Every model loaded and gated (or, with VAE_READY_PARTIAL, at least one), worker up."""
        if self.loading or not self.models or self.worker_died:
            return False
        return not self.errors or self.settings.ready_partial

    @property
    def worker_died(self) -> bool:
        return self._worker is not None and not self._worker.is_alive() and not self._stopping

    # --- queue -------------------------------------------------------------
    def start(self) -> None:
        self._worker = threading.Thread(target=self._run, name="decode-worker", daemon=True)
        self._worker.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, cancel the queued ones, let the running one finish."""
        self._stopping = True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                _fail(job, Stopped("the service is shutting down"))
        if self._worker is not None:
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                return
            self._worker.join(timeout)

    def submit(self, job: Job) -> Future:
        if self._stopping:
            raise Stopped("the service is shutting down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull from None
        self.metrics.queue_depth.set(self._queue.qsize())
        return job.future

    def _run(self) -> None:
        while True:
            job = self._pending or self._queue.get()
            self._pending = None
            if job is None:
                return
            batch: list[Job] = [job]
            try:
                batch = self._gather(job)
                self.metrics.queue_depth.set(self._queue.qsize())
                self.metrics.inflight.set(len(batch))
                self._decode_batch(batch)
            except Exception as exc:  # a bug here must fail its jobs, not stop the worker
                log.exception("decode worker error")
                for j in batch:
                    _fail(j, exc)
            finally:
                self.metrics.inflight.set(0)

    def _gather(self, first: Job) -> list[Job]:
        """Consecutive queued jobs that can share one decode with ``first``; the ones whose
        caller left or whose deadline passed are dropped here, before any decoding."""
        batch, key = [first], first.batch_key()
        rows = first.latent.shape[0]
        while rows < self.settings.max_batch and first.stream is None:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if (
                nxt is None
                or nxt.stream is not None
                or nxt.batch_key() != key
                or rows + nxt.latent.shape[0] > self.settings.max_batch
            ):
                self._pending = nxt
                break
            batch.append(nxt)
            rows += nxt.latent.shape[0]
        now = time.perf_counter()
        return [j for j in batch if _admit(j, now)]

    def _decode_batch(self, batch: list[Job]) -> None:
        if not batch:
            return
        start = time.perf_counter()
        for job in batch:
            job.timer.add("queue", start - job.enqueued)
        if batch[0].stream is not None:
            return self._stream(batch[0])
        if len(batch) == 1:
            return self._decode_alone(batch[0])
        try:
            out = self._decode_jobs(batch)
        except Exception as exc:
            log.warning("a batch of %d failed (%s); decoding its jobs one by one", len(batch), exc)
            out = None
        if out is None:  # find the one that fails: the others still get their output
            for job in batch:
                self._decode_alone(job)
            return
        rows = 0
        for job in batch:
            n = job.latent.shape[0]
            job.future.set_result(out[rows : rows + n])
            rows += n

    def _decode_jobs(self, batch: list[Job]) -> Tensor:
        """One decode for the whole batch; the others get the shared decode's phases."""
        lead = batch[0]
        if len(batch) == 1:
            return self.decode(lead.model, lead.latent, lead.scaling, lead.options, lead.timer)
        before = lead.timer.phases()
        latent = torch.cat([j.latent for j in batch])
        out = self.decode(lead.model, latent, lead.scaling, lead.options, lead.timer)
        shared = {k: v - before.get(k, 0.0) for k, v in lead.timer.phases().items()}
        for job in batch[1:]:
            for phase, seconds in shared.items():
                if seconds > 0:  # not the lead's own parse and queue time
                    job.timer.add(phase, seconds)
        return out

    def _decode_alone(self, job: Job) -> None:
        try:
            job.future.set_result(self._decode_jobs([job]))
        except Exception as exc:
            log.exception("decode failed for model %s", job.model.name)
            job.future.set_exception(exc)

    def _stream(self, job: Job) -> None:
        """Decode chunk by chunk into ``job.stream``; the future resolves when all are out."""
        try:
            for chunk in self._stream_chunks(job):
                if not _put(job, chunk):
                    break  # nobody is reading: stop decoding
                _settle(job.first, None)
        except Exception as exc:
            log.exception("streamed decode failed for model %s", job.model.name)
            if not _settle(job.first, exc):
                _put(job, exc)  # mid-stream: the reader raises it
            job.future.set_exception(exc)
            return
        _settle(job.first, None)
        _put(job, None)
        job.future.set_result(None)

    def _stream_chunks(self, job: Job) -> Iterator[Tensor]:
        """Chunks in [0, 1] in order. On a device OOM the decode resumes on the next path,
        skipping the frames already sent (decoding is deterministic)."""
        sent, paths = 0, self._paths(job.model)
        for i, (decoder, extra, _) in enumerate(paths):
            skip = sent
            try:
                with torch.inference_mode():
                    z = self._prepare(decoder, job.latent, job.scaling, job.timer)
                    for chunk in decoder.iter_decode(z, job.timer, **job.options, **extra):
                        unit = decoder.to_unit(chunk.float()).cpu()[:, :, skip:]
                        skip = max(0, skip - chunk.shape[2])
                        if unit.shape[2]:
                            sent += unit.shape[2]
                            yield unit
                return
            except Exception as exc:
                if not is_oom(exc) or i == len(paths) - 1:
                    raise
                self._note_retry(job.model, paths[i][2], paths[i + 1][2])

    # --- decoding ----------------------------------------------------------
    def decode(
        self,
        model: ServedModel,
        latent: Tensor,
        scaling: Scaling,
        options: dict[str, Any],
        timer: PhaseTimer,
    ) -> Tensor:
        """De-normalize and decode on the served path; on a device OOM retry tiled (if the
        decoder can), then on the float32 CPU path. Each retry is counted."""
        paths = self._paths(model)
        for i, (decoder, extra, _) in enumerate(paths):
            try:
                with torch.inference_mode():
                    return self._decode_on(decoder, latent, scaling, {**options, **extra}, timer)
            except Exception as exc:
                if not is_oom(exc) or i == len(paths) - 1:
                    raise
                self._note_retry(model, paths[i][2], paths[i + 1][2])
        raise AssertionError("unreachable")

    @staticmethod
    def _paths(model: ServedModel) -> list[tuple[VAEDecoder, dict[str, Any], str]]:
        """(decoder, extra options, label): the served path, its tiled variant, the CPU path."""
        paths: list[tuple[VAEDecoder, dict[str, Any], str]] = [(model.active, {}, "served")]
        tiled = getattr(model.active, "tiled_retry_options", None) or TILED_RETRY.get(
            model.manifest.family
        )
        if tiled:
            paths.append((model.active, dict(tiled), "tiled"))
        if model.active is not model.reference:
            paths.append((model.reference, {}, "cpu"))
        return paths

    def _note_retry(self, model: ServedModel, failed: str, path: str) -> None:
        log.warning("model %s: out of memory on the %s path, retrying %s", model.name, failed, path)
        self.metrics.retries_total.labels(model.name, "oom", path).inc()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @staticmethod
    def _prepare(
        decoder: VAEDecoder, latent: Tensor, scaling: Scaling, timer: PhaseTimer
    ) -> Tensor:
        """Upload to the decoder's device and de-normalize (in float32)."""
        param = next(decoder.parameters())
        with timer.phase("upload"):
            z = latent.to(param.device, non_blocking=True)
        with timer.phase("denormalize"):
            z = scaling.apply(decoder, z.float())
        timer.device = param.device
        return z

    def _decode_on(
        self,
        decoder: VAEDecoder,
        latent: Tensor,
        scaling: Scaling,
        options: dict[str, Any],
        timer: PhaseTimer,
    ) -> Tensor:
        z = self._prepare(decoder, latent, scaling, timer)
        out = decoder.decode(z, timer, **options)
        with timer.phase("download"):
            return out.float().cpu()


def is_oom(exc: BaseException) -> bool:
    """A device out-of-memory error, or the CPU allocator's (a plain RuntimeError)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def _admit(job: Job, now: float) -> bool:
    """Mark a job running, unless its caller left or its deadline passed (then refuse it)."""
    if job.abandoned.is_set() or not job.future.set_running_or_notify_cancel():
        return False
    if job.deadline is not None and now > job.deadline:
        _fail(job, DeadlineExceeded(now - job.enqueued))
        return False
    return True


def _fail(job: Job, exc: BaseException) -> None:
    """Resolve a job (and its first-chunk future) with an error, whatever state it is in."""
    _settle(job.first, exc)
    if job.future.cancelled() or job.future.done():
        return
    if job.future.running() or job.future.set_running_or_notify_cancel():
        job.future.set_exception(exc)


def _settle(future: Future, outcome: object) -> bool:
    """Resolve a future once (a result, or an exception); False when it already was."""
    if future.done() or not future.set_running_or_notify_cancel():
        return False
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
    return True


def _put(job: Job, item: object) -> bool:
    """Hand an item to the stream's reader; False once it went away or stalled too long."""
    deadline = time.monotonic() + job.stall_s
    while not job.abandoned.is_set():
        try:
            job.stream.put(item, timeout=0.2)
            return True
        except queue.Full:
            if time.monotonic() > deadline:
                log.warning("stream reader of model %s stalled; dropping it", job.model.name)
                job.abandoned.set()
    return False


def _has_non_float32(module: torch.nn.Module) -> bool:
    return any(p.dtype != torch.float32 for p in module.parameters())
