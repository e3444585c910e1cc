"""The runtime: a registry (load + gate every part, decoder and encoder), a runner (one run of a
part, with its memory ladder) and a scheduler (queue, deadlines, micro-batching, chunks, the
worker), held together by ``Runtime``, which is what the HTTP service and the command line
use."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from app.config import Settings
from app.protocol import Limits
from app.protocol.request import DecodeRequest
from app.runtime import compiled, heap, host_memory
from app.runtime.parts import ServedPart
from app.runtime.registry import Registry
from app.runtime.runner import Runner, weight_bytes
from app.runtime.scheduler import Job, Scheduler
from app.telemetry.metrics import Metrics
from app.telemetry.timing import PhaseTimer

log = logging.getLogger("app.runtime")

__all__ = ["Job", "Runtime", "ServedPart"]


class Runtime:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.registry = Registry(settings, metrics)
        self.runner = Runner(
            metrics,
            settings.oom_fallback,
            settings.device_memory_bytes(),
            settings.max_decode_mpixels << 20,
            max_planned_bytes=settings.max_decode_mb << 20,
        )
        self.process_bytes = host_memory.resident()  # the interpreter and torch, no model yet
        self._held: tuple[tuple, int] | None = None  # resident_bytes's last (key, bytes)
        self.runner.resident = self.resident_bytes
        self.scheduler = Scheduler(
            self.runner,
            metrics,
            settings.queue_depth,
            settings.batch_rows,
            self._device_lost,
            settings.batch_window_ms / 1000,
            max_streams=settings.streams_max,
            on_idle=heap.release_when_reusing,
            idle_s=settings.heap_idle_s,
        )
        self.on_device_lost: Callable[[str], None] = lambda reason: None

    # --- what the service reads -----------------------------------------------------------
    @property
    def models(self) -> dict[str, ServedPart]:
        """The served decoders, by model name."""
        return self.registry.models

    @property
    def encoders(self) -> dict[str, ServedPart]:
        """The served encoders, by model name (entries that hold one)."""
        return self.registry.encoders

    @property
    def encoder_errors(self) -> dict[str, str]:
        return self.registry.encoder_errors

    @property
    def errors(self) -> dict[str, str]:
        return self.registry.errors

    @property
    def loading(self) -> bool:
        return self.registry.loading

    @property
    def ready(self) -> bool:
        return self.registry.ready and not self.scheduler.worker_died and not self.device_lost

    @property
    def device_lost(self) -> str:
        return self.scheduler.device_lost

    @property
    def worker_died(self) -> bool:
        return self.scheduler.worker_died

    # --- lifecycle ------------------------------------------------------------------------
    def load_all(self) -> None:
        """Load and gate every part (ready), then, while serving, measure the deferred parts'
        modes (app/runtime/registry.select_pending) and warm up the configured shapes."""
        self.registry.loading = True
        try:
            self.registry.load_all()
            self.warm_up()
        finally:
            self.registry.loading = False
        if self.registry.pending:
            self.registry.select_pending()
            self.warm_up()  # the winners' own first decodes
        if not self.registry.stopping:
            self.compile_warm_up_shapes()
        heap.release_when_reusing()  # what the start's probes and losing copies held

    def start(self) -> None:
        self.scheduler.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.registry.stopping = True  # the after-ready measurements end with the part at hand
        self.scheduler.stop(timeout)

    def submit(self, job: Job):
        return self.scheduler.submit(job)

    def withdraw(self, job: Job) -> None:
        self.scheduler.withdraw(job)

    def resident_bytes(self, device: torch.device) -> int:
        """What stays resident on ``device`` whatever runs: every served part's weights there
        (the exact CPU copy and the served one), and on the CPU the process as it started."""
        parts = [*self.registry.models.values(), *self.registry.encoders.values()]
        modules = {id(m): m for part in parts for m in (part.reference, part.fast)}
        key = (device.type, *sorted(modules))
        held = self._held
        if held is None or held[0] != key:  # summed again only when the served copies change
            weights = sum(weight_bytes(m, device) for m in modules.values())
            held = self._held = (key, weights + (self.process_bytes if device.type == "cpu" else 0))
        return held[1]

    def limits(self, part: ServedPart) -> Limits:
        """What one request for ``part`` may ask: the server's limits tightened by the part's
        manifest, and, where it cannot tile, the most one run could ever plan here."""
        return replace(
            part.limits(self.settings.limits()), max_run_bytes=self.runner.capacity(part)
        )

    def warm_up(self) -> None:
        """Decode each ``VAE_WARMUP_SHAPES`` shape once on every model it fits, on the decode
        worker: cuDNN's algorithm search, the allocator's growth and the per-thread handles are
        then paid before the first request, not by it."""
        shapes = parse_shapes(self.settings.warmup_shapes)
        for model in list(self.registry.models.values()):
            for shape in (s for s in shapes if _fits(model, s)):
                timer = PhaseTimer()
                request = DecodeRequest(torch.zeros(shape))
                decode = partial(self.runner.decode, model, request, timer)
                self.scheduler.call(decode)
                seconds = sum(timer.phases().values())
                log.info("warmed up %s at %s in %.3f s", model.name, shape, seconds)

    def compile_warm_up_shapes(self) -> None:
        """Compile the warm-up shapes where ``VAE_COMPILE`` allows, after ready, on this thread
        while the worker serves eagerly; each graph is gated before it is swapped in."""
        shapes = parse_shapes(self.settings.warmup_shapes)
        todo = [
            (model, fitting)
            for model in list(self.registry.models.values())
            if (fitting := [s for s in shapes if _fits(model, s)])
            and compiled.eligible(model, self.settings.compile)
        ]
        if not todo:
            return
        compiled.configure_cache(self.settings.compile_cache_dir)
        for model, fitting in todo:
            try:
                compiled.compile_shapes(model, fitting, self.settings.parity_min_cos)
            except Exception as exc:  # a compile that fails leaves the eager path serving
                log.error("model %s: compile failed, serving eagerly: %s", model.name, exc)
            if model.state is not None:
                self.metrics.model_load_seconds.labels(model.name, "compile").set(
                    model.state.phases.get("compile", 0.0)
                )
        compiled.save_cache(self.settings.compile_cache_dir)

    def _device_lost(self, reason: str) -> None:
        self.on_device_lost(reason)


def _fits(model: ServedPart, shape: tuple[int, ...]) -> bool:
    video = model.reference.is_video
    return shape[1] == model.reference.latent_channels and (len(shape) == 5) == video


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"1x16x128x128, 1x128x3x16x16"`` -> shapes."""
    shapes = []
    for part in re.split(r"[,;\s]+", text.strip()):
        if part:
            shapes.append(tuple(int(n) for n in part.lower().split("x")))
    return shapes
