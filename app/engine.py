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
from app.protocol import ModelGeometry
from app.store import Manifest, StoreError, list_models, load_model
from app.timing import PhaseTimer

log = logging.getLogger("app.engine")


class QueueFull(Exception):
    """The bounded queue is full: the caller answers 429 with Retry-After."""


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
    # Streaming (MP4): chunks in [0, 1] are put here as they are decoded, then None; the
    # bound keeps a slow encoder from letting decoded frames pile up.
    stream: queue.Queue | None = None
    abandoned: threading.Event = field(default_factory=threading.Event)  # the reader went away

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

    # --- loading -----------------------------------------------------------
    def load_all(self) -> None:
        """Load every configured store entry and run its gate (a failing one is reported)."""
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
            except (StoreError, RuntimeError, ValueError, KeyError) as exc:
                self.errors[name] = str(exc)
                log.error("model %s not served: %s", name, exc)
        self.loading = False

    def _load_one(self, store: Path, name: str, device: torch.device) -> ServedModel:
        t0 = time.perf_counter()
        manifest, decoder = load_model(store, name)
        reference = decoder.float() if _has_non_float32(decoder) else decoder
        fast, dtype, gate = reference, torch.float32, fastpath.GateResult(1.0, True)
        for dtype in fastpath.candidate_dtypes(self.settings.dtype, device):
            fast = fastpath.make_fast(reference, device, dtype)
            gate = fastpath.parity_gate(fast, reference, self.settings.parity_min_cos)
            log.info("model %s: %s %s parity cosine %.7f", name, device, dtype, gate.cosine)
            if gate.passed:
                break
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
        self.metrics.parity_cosine.labels(name).set(gate.cosine)
        self.metrics.fallback_active.labels(name).set(int(served.fallback))
        self.metrics.model_load_seconds.labels(name).set(served.load_seconds)
        return served

    @property
    def ready(self) -> bool:
        return not self.loading and bool(self.models) and not self.errors

    # --- queue -------------------------------------------------------------
    def start(self) -> None:
        self._worker = threading.Thread(target=self._run, name="decode-worker", daemon=True)
        self._worker.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout)

    def submit(self, job: Job) -> Future:
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
            batch = self._gather(job)
            self.metrics.queue_depth.set(self._queue.qsize())
            self.metrics.inflight.set(len(batch))
            try:
                self._decode_batch(batch)
            finally:
                self.metrics.inflight.set(0)

    def _gather(self, first: Job) -> list[Job]:
        """Consecutive queued jobs that can share one decode with ``first``."""
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
        return [j for j in batch if j.future.set_running_or_notify_cancel()]

    def _decode_batch(self, batch: list[Job]) -> None:
        if not batch:
            return
        start = time.perf_counter()
        for job in batch:
            job.timer.add("queue", start - job.enqueued)
        lead = batch[0]
        if lead.stream is not None:
            return self._stream(lead)
        try:
            latent = torch.cat([j.latent for j in batch]) if len(batch) > 1 else lead.latent
            out = self.decode(lead.model, latent, lead.scaling, lead.options, lead.timer)
        except Exception as exc:  # one bad decode must not take the worker down
            log.exception("decode failed for model %s", lead.model.name)
            for job in batch:
                job.future.set_exception(exc)
            return
        rows = 0
        for job in batch:
            n = job.latent.shape[0]
            if job is not lead:
                for phase, seconds in lead.timer.phases().items():
                    job.timer.add(phase, seconds)
            job.future.set_result(out[rows : rows + n])
            rows += n

    def _stream(self, job: Job) -> None:
        """Decode chunk by chunk into ``job.stream``; the future resolves when all are out."""
        decoder = job.model.active
        try:
            with torch.inference_mode():
                z = self._prepare(decoder, job.latent, job.scaling, job.timer)
                for chunk in decoder.iter_decode(z, job.timer, **job.options):
                    if not _put(job, decoder.to_unit(chunk.float()).cpu()):
                        break  # nobody is reading: stop decoding
        except Exception as exc:
            log.exception("streamed decode failed for model %s", job.model.name)
            _put(job, exc)
            job.future.set_exception(exc)
            return
        _put(job, None)
        job.future.set_result(None)

    # --- decoding ----------------------------------------------------------
    @torch.inference_mode()
    def decode(
        self,
        model: ServedModel,
        latent: Tensor,
        scaling: Scaling,
        options: dict[str, Any],
        timer: PhaseTimer,
    ) -> Tensor:
        """De-normalize and decode on the served path; on a device OOM retry on the CPU path."""
        try:
            return self._decode_on(model.active, model, latent, scaling, options, timer)
        except torch.OutOfMemoryError:
            if model.active is model.reference:
                raise
            log.warning(
                "model %s: device out of memory, retrying on the float32 CPU path", model.name
            )
            self.metrics.retries_total.labels(model.name, "oom", "cpu").inc()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return self._decode_on(model.reference, model, latent, scaling, options, timer)

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
        model: ServedModel,
        latent: Tensor,
        scaling: Scaling,
        options: dict[str, Any],
        timer: PhaseTimer,
    ) -> Tensor:
        z = self._prepare(decoder, latent, scaling, timer)
        out = decoder.decode(z, timer, **options)
        with timer.phase("download"):
            return out.float().cpu()


def _put(job: Job, item: object) -> bool:
    """Hand an item to the stream's reader; False once the reader has gone away."""
    while not job.abandoned.is_set():
        try:
            job.stream.put(item, timeout=0.5)
            return True
        except queue.Full:
            continue
    return False


def _has_non_float32(module: torch.nn.Module) -> bool:
    return any(p.dtype != torch.float32 for p in module.parameters())
