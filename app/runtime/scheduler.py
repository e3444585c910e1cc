"""The scheduler: one bounded queue and one worker per device, for decodes and encodes alike.

The event loop never runs a decode or an encode: handlers ``submit`` a ``Job`` and await its
future. The worker takes jobs in order and micro-batches consecutive ones of the same part,
input shape and options (waiting up to ``VAE_BATCH_WINDOW_MS`` for them). This is the one
place batching is decided: a micro-batch takes at most ``row_cap`` rows (``VAE_BATCH_ROWS``,
the manifest's ``max_batch``, and the runner's plan of what fits the device), a job of more
rows runs in several, and each job gets its own rows' outputs back. A job whose caller left,
or whose deadline passed before it could start, is dropped before any work.

Long work does not hold short work: a chunked job (a streamed video decode: every video
answer, an MP4 or its frames as tensor bytes; a video encode)
runs one chunk at a time, and between its chunks (and while a stream's buffer is full) the
worker serves whatever other work is queued, so a small request waits about one chunk, not
whole videos. Chunked jobs run one at a time, in order (each holds its module's working
state); at most ``max_streams`` streams are admitted at once, queued or running or still
sending (``StreamsFull`` past that).

Once the worker has had nothing to do for ``idle_s``, it runs ``on_idle`` (the runtime's: give
a reused heap's free pages back, app/runtime/heap.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from app.protocol import Limits
from app.protocol.request import DecodeRequest, EncodeRequest
from app.runtime import device as devices
from app.runtime.channel import FrameChannel
from app.runtime.parts import ENCODER, ServedPart
from app.runtime.runner import InvalidInput, NonFiniteOutput, NoRoomNow, Runner, TooLarge
from app.telemetry.metrics import Metrics
from app.telemetry.timing import PhaseTimer

log = logging.getLogger("app.runtime.scheduler")
# answered 413 / 422 (the request's own), or 503 by the plan (load): warnings, not errors
REFUSALS = (TooLarge, InvalidInput, NonFiniteOutput, NoRoomNow)


class QueueFull(Exception):
    """The bounded queue is full: the caller answers 429 with Retry-After."""


class StreamsFull(QueueFull):
    """As many streams as ``max_streams`` are admitted: 429 with Retry-After."""


class Stopped(Exception):
    """The service is shutting down: the caller answers 503 with Retry-After."""


class DeviceLost(Exception):
    """The device hit an unrecoverable error: this instance is going away (503)."""


class DeadlineExceeded(Exception):
    """The job's deadline passed before the worker could start it: refused, not decoded."""

    def __init__(self, waited: float) -> None:
        super().__init__(f"the request's deadline passed after {waited:.2f} s in the queue")
        self.waited = waited


@dataclass(frozen=True, eq=False)
class Job:
    """A request on its way through the queue (a decode or an encode): built once, never
    reassigned."""

    part: ServedPart
    request: DecodeRequest | EncodeRequest
    timer: PhaseTimer
    channel: FrameChannel | None = None  # streamed (a video): frames go here as they decode
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)
    abandoned: threading.Event = field(default_factory=threading.Event)  # the caller left

    @property
    def rows(self) -> int:
        return self.request.rows

    @property
    def deadline(self) -> float | None:
        """perf_counter time by which the job must have started."""
        return self.request.deadline

    @property
    def chunked(self) -> bool:
        """Run chunk by chunk, alone (a stream, or a video encode), serving others between."""
        if self.channel is not None:
            return True
        return self.part.part == ENCODER and self.request.video and self.part.reference.is_video

    def abandon(self) -> None:
        """The caller went away: drop the job if it is still queued, stop it if it streams."""
        self.abandoned.set()
        self.future.cancel()
        if self.channel is not None:
            self.channel.drop("the client went away")

    def batch_key(self) -> tuple:
        return (self.part.name, self.part.part, *self.request.batch_key())


@dataclass(eq=False)
class Call:
    """Device work that is not a request (warm-up, compiles), run on the worker: the thread
    whose cuDNN handles and algorithm caches the requests will use."""

    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)
    deadline: float | None = None  # perf_counter time by which it must have started
    enqueued: float = field(default_factory=time.perf_counter)
    abandoned: threading.Event = field(default_factory=threading.Event)

    def abandon(self) -> None:
        self.abandoned.set()
        self.future.cancel()


class Scheduler:
    def __init__(
        self,
        runner: Runner,
        metrics: Metrics,
        queue_depth: int,
        batch_rows: int,
        on_device_lost: Callable[[str], None],
        batch_window_s: float = 0.0,
        max_streams: int = 8,
        on_idle: Callable[[], None] | None = None,
        idle_s: float = 1.0,
    ) -> None:
        self.runner = runner
        self.metrics = metrics
        self.batch_rows = batch_rows  # VAE_BATCH_ROWS: rows per micro-batch, at most
        self.batch_window_s = batch_window_s  # VAE_BATCH_WINDOW_MS: wait this long to fill one
        self.on_device_lost = on_device_lost
        self.device_lost = ""  # why the device is unusable, once it is
        self._queue: queue.Queue[Job | Call | None] = queue.Queue(maxsize=queue_depth)
        self._worker: threading.Thread | None = None
        # Taken off the queue, not run yet (under ``_taken_lock``: ``withdraw`` looks here too):
        self._pending: Job | Call | None = None  # the item that did not join a micro-batch
        self._streams_waiting: deque[Job] = deque()  # chunked jobs taken during a stream
        self._taken_lock = threading.Lock()
        self._stopping = False
        self._stop_seen = False  # the stop sentinel came while a stream ran: exit after it
        self.max_streams = max_streams
        self.streams = 0  # admitted streams not yet free (queued, decoding or sending)
        self._streams_lock = threading.Lock()
        self.on_idle = on_idle  # run once each time the worker has waited ``idle_s`` for work
        self.idle_s = idle_s

    @property
    def worker_died(self) -> bool:
        return self._worker is not None and not self._worker.is_alive() and not self._stopping

    def start(self) -> None:
        self._worker = threading.Thread(target=self._run, name="decode-worker", daemon=True)
        self._worker.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, fail the queued ones, let the running one finish."""
        self._stopping = True
        self.fail_queued(Stopped("the service is shutting down"))
        if self._worker is not None:
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                return
            self._worker.join(timeout)

    def fail_queued(self, exc: BaseException) -> int:
        """Answer every job still waiting (queued, or taken off the queue and not run yet)
        with ``exc``; how many there were."""
        failed = 0
        for item in self._waiting_items():
            if isinstance(item, Call):
                if not item.future.done():  # an abandoned call's future is cancelled
                    item.future.set_exception(exc)
            else:
                fail(item, exc)
                failed += 1
        self._count_waiting()
        return failed

    def _waiting_items(self) -> Iterator[Job | Call]:
        """Take every waiting item: those taken off the queue first, then the queue's (the
        stop sentinel skipped), without waiting."""
        while (item := self._take_held()) is not None:
            yield item
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                yield item

    def _count_waiting(self) -> None:
        """``vae_queue_depth``: every job waiting for the worker, taken off the queue or not."""
        with self._taken_lock:
            taken = len(self._streams_waiting) + (self._pending is not None)
        self.metrics.queue_depth.set(self._queue.qsize() + taken)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the decode worker and return its result (inline if none runs)."""
        if self._worker is None or not self._worker.is_alive():
            return fn()
        item = Call(fn)
        self._queue.put(item)
        return item.future.result()

    def submit(self, job: Job) -> Future:
        if self._stopping:
            raise Stopped("the service is shutting down")
        if self.device_lost:
            raise DeviceLost(self.device_lost)
        if job.channel is not None:
            self._admit_stream(job.channel)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            if job.channel is not None:
                job.channel.close()  # gives its slot back
            raise QueueFull from None
        self._count_waiting()
        return job.future

    def withdraw(self, job: Job) -> None:
        """Take a job that waits out (its caller left, or its deadline passed while it
        waited): its queue slot, its stream slot and its input are free at once, not when the
        worker reaches it. A job the worker runs already is left to it."""
        if not (self._unqueue(job) or self._untake(job)):
            return
        self._count_waiting()
        if job.channel is not None:
            job.channel.close()  # never streamed: its stream slot is free

    def _unqueue(self, job: Job) -> bool:
        with self._queue.mutex:  # queue.Queue's own lock and deque: no API removes one item
            try:
                self._queue.queue.remove(job)
            except ValueError:
                return False
            self._queue.not_full.notify()
        return True

    def _untake(self, job: Job) -> bool:
        with self._taken_lock:
            if self._pending is job:
                self._pending = None
                return True
            try:
                self._streams_waiting.remove(job)
            except ValueError:
                return False
        return True

    def _take_held(self) -> Job | Call | None:
        """The next item taken off the queue already: the one that did not join a
        micro-batch, else the first stream waiting its turn."""
        with self._taken_lock:
            item, self._pending = self._pending, None
            if item is None and self._streams_waiting:
                item = self._streams_waiting.popleft()
            return item

    def _take_pending(self) -> Job | Call | None:
        """The item that did not join a micro-batch, if any (streams keep waiting)."""
        with self._taken_lock:
            item, self._pending = self._pending, None
            return item

    def _hold(self, item: Job | Call, *, stream: bool = False) -> None:
        """Keep ``item`` to run later; one withdrawn while the worker held it is dropped, as
        ``admit`` would (its future is cancelled before ``withdraw`` looks here)."""
        with self._taken_lock:
            withdrawn = item.future.cancelled()
            if not withdrawn and stream:
                self._streams_waiting.append(item)
            elif not withdrawn:
                self._pending = item
        if withdrawn and isinstance(item, Job) and item.channel is not None:
            item.channel.close()  # never streamed: its stream slot is free

    def _admit_stream(self, channel: FrameChannel) -> None:
        with self._streams_lock:
            if self.streams >= self.max_streams:
                raise StreamsFull(
                    f"{self.streams} streams are running (the most is {self.max_streams})"
                )
            self.streams += 1
        channel.on_free = self._stream_freed

    def _stream_freed(self) -> None:
        with self._streams_lock:
            self.streams -= 1

    # --- the worker -------------------------------------------------------------------------
    def _run(self) -> None:
        item: Job | Call | None = None
        try:
            while not self._stop_seen:
                item = self._take_held()
                item = item if item is not None else self._next()
                self._run_item(item)
        except BaseException as exc:  # a bug in the worker itself: as a lost device, so the
            # waiting requests get 503s at once and the process exits to be replaced (a live
            # process without its worker would pass /healthz and time every request out)
            log.exception("the decode worker stopped")
            self.device_lost = f"the decode worker stopped: {type(exc).__name__}: {exc}"[:240]
            if isinstance(item, Job):
                fail(item, DeviceLost(self.device_lost))
            self.fail_queued(DeviceLost(self.device_lost))
            self.on_device_lost(self.device_lost)
            return
        self.fail_queued(Stopped("the service is shutting down"))

    def _next(self) -> Job | Call | None:
        """The next queued item; once none has come for ``idle_s``, ``on_idle`` runs (once)
        before the wait goes on."""
        if self.on_idle is None:
            return self._queue.get()
        try:
            return self._queue.get(timeout=self.idle_s)
        except queue.Empty:
            self.on_idle()
            return self._queue.get()

    def _run_item(self, item: Job | Call | None) -> None:
        if item is None:
            self._stop_seen = True
        elif isinstance(item, Call):
            _run_call(item)
        else:
            self._run_job(item)

    def _serve_others(self) -> bool:
        """Between a stream's chunks: run the work queued now (streams wait their turn).
        Whether there was any."""
        did = False
        for _ in range(self._queue.qsize() + 1):
            item = self._take_pending()
            if item is None:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            did = True
            if isinstance(item, Job) and item.chunked:
                self._hold(item, stream=True)
            elif item is None:
                self._stop_seen = True  # finish this stream, then exit
                break
            else:
                self._run_item(item)
        return did

    def _run_job(self, job: Job) -> None:
        batch: list[Job] = [job]
        try:
            batch = self._gather(job)
            self._count_waiting()
            self.metrics.inflight.set(len(batch))
            self._decode_batch(batch)
        except Exception as exc:  # a bug here must fail its jobs, not stop the worker
            log.exception("worker error")
            for j in batch:
                fail(j, exc)
        finally:
            self.metrics.inflight.set(0)

    def row_cap(self, job: Job) -> int:
        """Rows one micro-batch of ``job``'s kind may take: ``VAE_BATCH_ROWS``, the model's
        own ``max_batch`` (its manifest), and what the runner plans to fit the device."""
        cap = Limits(max_batch=self.batch_rows).tightened(job.part.manifest.config).max_batch
        fits = self.runner.rows_that_fit(job.part, tuple(job.request.input.shape))
        return max(1, min(cap, fits))

    def _gather(self, first: Job) -> list[Job]:
        """Consecutive queued jobs that can share one decode with ``first``; with a batch
        window, waits up to that long for them to arrive."""
        batch, key = [first], first.batch_key()
        rows, cap = first.rows, self.row_cap(first)
        until = time.perf_counter() + self.batch_window_s
        while rows < cap and not first.chunked:
            try:
                wait = until - time.perf_counter()
                nxt = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:  # the stop sentinel: finish this batch, then exit
                self._stop_seen = True
                break
            if (
                isinstance(nxt, Call)
                or nxt.chunked
                or nxt.batch_key() != key
                or rows + nxt.rows > cap
            ):
                self._hold(nxt)
                break
            batch.append(nxt)
            rows += nxt.rows
        now = time.perf_counter()
        return [j for j in batch if admit(j, now)]

    def _decode_batch(self, batch: list[Job]) -> None:
        if not batch:
            return
        start = time.perf_counter()
        for job in batch:
            job.timer.add("queue", start - job.enqueued)
        if batch[0].chunked:
            return self._run_chunked(batch[0])
        try:
            outs = self._decode_jobs(batch)
        except Exception as exc:
            if len(batch) == 1 or self._lost(exc):
                return self._failed(batch, exc)
            log.warning("a batch of %d failed (%s); decoding its jobs one by one", len(batch), exc)
            for job in batch:  # find the one that fails: the others still get their output
                try:
                    job.future.set_result(self._decode_jobs([job])[0])
                except Exception as one:
                    self._failed([job], one)
            return
        for job, out in zip(batch, outs, strict=True):
            job.future.set_result(out)

    def _decode_jobs(self, batch: list[Job]) -> list[Tensor]:
        """The batch's rows in micro-batches of at most ``row_cap`` rows (one job's rows may
        span several); each job gets its own rows' outputs back, and every job the shared
        runs' phases."""
        lead = batch[0]
        timer = PhaseTimer() if len(batch) > 1 else lead.timer
        inputs = [j.request.input for j in batch]
        joined = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
        cap = self.row_cap(lead)
        rows: list[Tensor] = []
        for piece in joined.split(cap):
            self.metrics.batch_rows.labels(lead.part.name).observe(piece.shape[0])
            rows += self.runner.rows(lead.part, lead.request.with_input(piece), timer)
        if len(batch) > 1:
            for job in batch:
                for phase, seconds in timer.phases().items():
                    job.timer.add(phase, seconds)
        outs, at = [], 0
        for job in batch:
            outs.append(torch.cat(rows[at : at + job.rows]))
            at += job.rows
        return outs

    def _run_chunked(self, job: Job) -> None:
        """Run chunk by chunk, serving the other queued work between chunks (and while a
        stream's buffer is full): a stream's chunks go to its channel as they come, an
        encode's are assembled at the end; the future resolves then."""
        channel, kept = job.channel, []
        try:
            chunks = self.runner.chunks(job.part, job.request, job.timer)
            for chunk in chunks:
                if channel is None:
                    kept.append(chunk)
                elif not channel.put(chunk, idle=self._serve_others):
                    log.debug("model %s: stream dropped: %s", job.part.name, channel.dropped)
                    chunks.close()
                    break
                if job.abandoned.is_set():  # its caller left: the rest is for no one
                    chunks.close()
                    break
                self._serve_others()
            result = None
            if channel is None and not job.abandoned.is_set():
                result = self.runner.assemble(job.part, job.request, kept, job.timer)
        except Exception as exc:
            if channel is not None:
                channel.close(exc)
            self._failed([job], exc)
            return
        if channel is not None:
            channel.close()
        if not job.future.done():
            job.future.set_result(result)

    def _failed(self, batch: list[Job], exc: BaseException) -> None:
        if self._lost(exc):
            exc = DeviceLost(self.device_lost)
        else:  # a refusal (the request's own input, or the plan under load) is no fault
            level = logging.WARNING if isinstance(exc, REFUSALS) else logging.ERROR
            part = batch[0].part
            log.log(level, "%s failed for model %s: %s", part.part, part.name, exc)
        for job in batch:
            fail(job, exc)

    def _lost(self, exc: BaseException) -> bool:
        """A sticky device error: refuse everything from now on and report it once."""
        if not devices.is_sticky(exc):
            return bool(self.device_lost)
        if not self.device_lost:
            self.device_lost = f"{type(exc).__name__}: {str(exc)[:200]}"
            log.critical("device lost, taking this instance out of service: %s", exc)
            self.fail_queued(DeviceLost(self.device_lost))
            self.on_device_lost(self.device_lost)
        return True


def _run_call(call: Call) -> None:
    if call.abandoned.is_set() or not call.future.set_running_or_notify_cancel():
        return  # its caller left while it was queued
    now = time.perf_counter()
    if call.deadline is not None and now > call.deadline:
        call.future.set_exception(DeadlineExceeded(now - call.enqueued))
        return
    try:
        call.future.set_result(call.fn())
    except Exception as exc:
        call.future.set_exception(exc)


def admit(job: Job, now: float) -> bool:
    """Mark a job running, unless its caller left or its deadline passed (then refuse it)."""
    if job.abandoned.is_set() or not job.future.set_running_or_notify_cancel():
        if job.channel is not None:
            job.channel.close()  # never streamed: its slot is free
        return False
    if job.deadline is not None and now > job.deadline:
        fail(job, DeadlineExceeded(now - job.enqueued))
        return False
    return True


def fail(job: Job, exc: BaseException) -> None:
    """Resolve a job (and its stream) with an error, whatever state it is in."""
    if job.channel is not None:
        job.channel.close(exc)
    if job.future.cancelled() or job.future.done():
        return
    if job.future.running() or job.future.set_running_or_notify_cancel():
        job.future.set_exception(exc)
