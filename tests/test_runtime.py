"""The runtime on the CPU: stage timing, the memory ladder, sticky device errors, streams.

GPU behaviour is exercised with the real code under a fake device-memory budget and the
``faulty`` family's injected errors; scripts/gpu_proof.sh proves the same on a real card."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time

import pytest
import requests
import torch
from torch import nn

from app.config import Settings
from app.families.minimax_h3 import decoder as minimax_h3
from app.protocol.request import DecodeRequest, Output
from app.runtime import Job, Runtime, host_memory
from app.runtime import runner as runner_module
from app.runtime.runner import OutOfMemory
from app.runtime.scheduler import DeviceLost, Scheduler
from app.store import load_model
from app.telemetry import timing
from app.telemetry.metrics import Metrics
from app.telemetry.timing import PhaseTimer
from tests import faulty, launch
from tests.helpers import raw_request, read_response
from tests.live import bake, live_server
from tests.mp4_client import ffmpeg_children


@pytest.fixture(scope="module", autouse=True)
def faulty_family():
    with faulty.registered():
        yield


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = tmp_path_factory.mktemp("runtime-store")
    faulty.bake(store, "faulty")
    faulty.bake(store, "faulty-video", video=True)
    faulty.bake(store, "faulty-pairs", max_batch=2)  # a manifest that lowers the batch
    return store


@pytest.fixture(scope="module")
def runtime(store):
    runtime = Runtime(Settings(models_dir=store, device="cpu", dtype="bfloat16"), Metrics())
    runtime.load_all()
    return runtime


def rows(*commands: tuple[float, float, float]) -> torch.Tensor:
    """A batch whose rows carry (command, arg, tag)."""
    return torch.cat([faulty.latent(*c) for c in commands])


def decode(runtime: Runtime, z: torch.Tensor, model: str = "faulty") -> torch.Tensor:
    served = runtime.models[model]
    return runtime.runner.decode(served, DecodeRequest(z, Output.TENSOR), PhaseTimer())


def retries(runtime: Runtime, path: str) -> float:
    return runtime.metrics.retries_total.labels("faulty", "oom", path)._value.get()


# --- timing -------------------------------------------------------------------------------


def test_host_phases_use_the_injected_clock_and_keep_their_order():
    now = [0.0]
    timer = PhaseTimer(clock=lambda: now[0])
    for name, seconds in [("parse", 0.5), ("queue", 2.0), ("parse", 0.25)]:
        with timer.phase(name):
            now[0] += seconds
    assert timer.phases() == {"parse": 0.75, "queue": 2.0}


def test_stage_hooks_time_only_the_active_timer_of_their_own_thread():
    """One resident module, two requests in two threads: each timer sees its own calls,
    and a call with no active timer (the gate, a test) records nothing anywhere."""
    stage = nn.Identity()
    timing.instrument([("mid", stage)])
    timing.instrument([("mid", stage)])  # idempotent: one hook pair
    timers = [PhaseTimer(), PhaseTimer()]
    calls = [3, 5]

    def run(timer: PhaseTimer, n: int) -> None:
        with timer.active():
            for _ in range(n):
                with timing.phase("blend"):
                    stage(torch.zeros(1))

    threads = [threading.Thread(target=run, args=a) for a in zip(timers, calls, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stage(torch.zeros(1))  # untimed
    for timer in timers:
        assert list(timer.phases()) == ["blend", "mid"]
        assert all(s >= 0 for s in timer.phases().values())
    assert len(stage._forward_hooks) == 1 and len(stage._forward_pre_hooks) == 1


def test_phases_never_wait_on_pending_device_work():
    """``phases`` only reports what ``resolve`` has turned into seconds."""
    timer = PhaseTimer()
    timer.add("parse", 0.1)
    timer.resolve()  # nothing pending: a no-op
    assert timer.phases() == {"parse": 0.1}


# --- the memory ladder --------------------------------------------------------------------


def scheduled(
    runtime: Runtime, z: torch.Tensor, batch_rows: int = 8, metrics=None, model: str = "faulty"
):
    """``z`` as one request through a scheduler of its own (the worker's micro-batching)."""
    scheduler = Scheduler(runtime.runner, metrics or Metrics(), 4, batch_rows, lambda r: None)
    scheduler.start()
    try:
        job = Job(runtime.models[model], DecodeRequest(z, Output.TENSOR), PhaseTimer())
        return scheduler.submit(job).result(timeout=60)
    finally:
        scheduler.stop()


def test_a_batch_over_the_budget_is_split_before_decoding(runtime, monkeypatch):
    served = runtime.models["faulty"]
    one = served.fast.planned_bytes((1, 4, 4, 4), 2)
    monkeypatch.setattr(runner_module.devices, "memory_budget", lambda d, c: int(2.5 * one))
    faulty.BATCHES.clear()
    out = scheduled(runtime, rows((0, 0, 81), (0, 0, 82), (0, 0, 83), (0, 0, 84), (0, 0, 85)))
    assert out.shape[0] == 5
    assert faulty.BATCHES == [2, 2, 1]  # pieces that fit, in order, nothing decoded twice
    assert [path for path, _ in faulty.decoded(83)] == ["fast"]


def test_a_latent_over_the_budget_is_decoded_tiled_or_refused(runtime, monkeypatch):
    served = runtime.models["faulty"]
    monkeypatch.setattr(runner_module.devices, "memory_budget", lambda d, c: 1000)
    decode(runtime, rows((0, 0, 86)))
    assert faulty.decoded(86) == [("tiled", 0)]
    monkeypatch.setattr(served.fast, "supports_tiling", False)
    with pytest.raises(OutOfMemory, match="MiB of host memory"):
        decode(runtime, rows((0, 0, 87)))
    assert faulty.decoded(87) == []  # refused before any decoding


def test_the_cpu_plans_into_the_hosts_memory(store):
    """On the CPU the budget is what the host has available (VAE_DEVICE_MEMORY_GB caps it,
    less the resident set): with room the latent decodes whole; capped under the process's
    own resident set, the same latent decodes tiled (one that cannot tile: 503, above)."""
    for tag, cap_gb, expected in ((137, 0.0, [("fast", 0)]), (138, 0.001, [("tiled", 0)])):
        settings = Settings(models_dir=store, device="cpu", dtype="bfloat16", models="faulty")
        runtime = Runtime(settings.model_copy(update={"device_memory_gb": cap_gb}), Metrics())
        runtime.load_all()
        decode(runtime, rows((0, 0, tag)))
        assert faulty.decoded(tag) == expected, cap_gb


def test_a_run_that_never_fits_the_host_is_413_one_that_may_later_503(tmp_path, caplog):
    """A part that cannot tile (MiniMax-H3's image decoder) under a cap a little above what
    this process holds: a run that fits is decoded; the same run while the process holds
    more for a while (another request's memory) may fit later (503 + Retry-After); one larger
    than the cap less what stays resident (the process, the weights) never fits this
    instance (413, from the declared shape before the body is sent)."""
    bake(tmp_path, "minimax-h3", "mm", minimax_h3.SYNTHETIC["minimax-h3-image-tiny"])
    _, decoder = load_model(tmp_path, "mm")
    small, large = torch.zeros(1, 24, 96, 96), torch.zeros(1, 24, 256, 256)
    plan = decoder.planned_bytes(tuple(small.shape), 4)  # about 100 MiB
    assert decoder.planned_bytes(tuple(large.shape), 4) > 4 * plan  # over the capacity
    # room for the server's own start (192 MiB) and 1.5 plans: a capacity of about 3 plans,
    # where the cap less the weights alone (this process is 400 MiB at least) would be 6
    cap = host_memory.resident() + (192 << 20) + 1.5 * plan / 0.8
    settings = dict(device="cpu", dtype="float32", max_pixels=4096 * 4096)
    with live_server(tmp_path, device_memory_gb=cap / 2**30, **settings) as url:
        assert _post_latent(url, small).status_code == 200
        held = torch.ones(1 << 28)  # 1 GiB more resident, for a while
        busy = _post_latent(url, small)
        del held
        target = f"/decode/mm?shape={json.dumps(list(large.shape))}&dtype=float32"
        length = {"Content-Length": str(large.nbytes)}
        code, body = read_response(raw_request(url, target.replace(" ", ""), headers=length))
    assert busy.status_code == 503 and "retry-after" in busy.headers, busy.text
    assert "MiB of host memory" in busy.json()["error"], busy.text
    planned = [r for r in caplog.records if "free to plan into now" in r.getMessage()]
    assert planned and {r.levelname for r in planned} == {"WARNING"}  # load, not a fault
    assert code == 413 and "one run here can plan at most" in body["error"], body


def _post_latent(url: str, z: torch.Tensor) -> requests.Response:
    return requests.post(
        f"{url}/decode/mm",
        params={"shape": json.dumps(list(z.shape)), "dtype": "float32", "output_type": "pt"},
        data=z.numpy().tobytes(),
        headers={"Content-Type": "tensor/binary"},
        timeout=60,
    )


def test_out_of_memory_splits_the_batch_then_tiles_the_row_that_needs_it(runtime):
    before = retries(runtime, "split"), retries(runtime, "tiled")
    out = decode(runtime, rows((faulty.OOM_UNTILED, 0, 71), (0, 0, 72)))
    assert out.shape[0] == 2
    assert faulty.decoded(71)[-1] == ("tiled", 0) and faulty.decoded(72)[-1] == ("fast", 0)
    assert ("cpu", 0) not in faulty.decoded(71)
    assert retries(runtime, "split") - before[0] == 1
    assert retries(runtime, "tiled") - before[1] == 1


def test_out_of_memory_on_every_rung_is_out_of_memory_not_a_cpu_decode(runtime):
    before = retries(runtime, "tiled"), retries(runtime, "cpu")
    with pytest.raises(OutOfMemory):
        decode(runtime, rows((faulty.OOM_ALL, 0, 73)))
    assert retries(runtime, "tiled") - before[0] == 1  # tried tiled once, then gave up
    assert retries(runtime, "cpu") == before[1]  # never the minutes-long CPU decode


def test_non_finite_output_is_refused(runtime):
    z = faulty.latent(tag=74)
    z[0, 3] = float("nan")
    with pytest.raises(runner_module.NonFiniteOutput):
        decode(runtime, z)


# --- a sticky device error -----------------------------------------------------------------


def post(url: str, z: torch.Tensor, model: str = "faulty", **params):
    return requests.post(
        f"{url}/decode/{model}",
        data=z.numpy().tobytes(),
        params={"shape": json.dumps(list(z.shape)), "output_type": "pt", **params},
        headers={"Content-Type": "tensor/binary"},
        timeout=30,
    )


def test_a_sticky_device_error_takes_the_instance_out_of_service(store):
    with live_server(store, device="cpu", dtype="bfloat16") as url:
        assert post(url, faulty.latent(tag=75)).status_code == 200
        r = post(url, faulty.latent(faulty.STICKY, tag=76))
        assert r.status_code == 503 and "lost its device" in r.json()["error"]
        ready = requests.get(f"{url}/readyz")
        assert ready.status_code == 503 and "device lost" in ready.json()["reason"]
        r = post(url, faulty.latent(tag=77))  # everything after is refused, not decoded
        assert r.status_code == 503 and faulty.decoded(77) == []


SERVE_FAULTY = (
    "import sys; from tests import faulty; faulty.register(); from app.cli import main; "
    "main(sys.argv[1:])"
)


def test_a_sticky_device_error_makes_the_server_exit(store, tmp_path):
    port = faulty.free_port()
    cmd = [sys.executable, "-c", SERVE_FAULTY, "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--models-dir", str(store)]
    env = {"VAE_DEVICE": "cpu", "VAE_DTYPE": "bfloat16", "VAE_DRAIN_GRACE_S": "2"}
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = launch.popen(
            cmd, cwd=faulty.ROOT, env={**faulty.os.environ, **env}, stdout=out, stderr=out
        )
    try:
        url = f"http://127.0.0.1:{port}"
        faulty._wait_ready(url, proc, log)
        assert post(url, faulty.latent(faulty.STICKY)).status_code == 503
        assert proc.wait(30) is not None  # it left, so the platform replaces it
        assert "device lost" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


# --- streams ------------------------------------------------------------------------------


def stalled_mp4_request(url: str, frames: int) -> socket.socket:
    """POST a long MP4 over a raw socket with a tiny receive buffer, read the status line,
    then read nothing more: a client that stalled."""
    z = faulty.latent(tag=78, size=128, frames=frames)
    z[0, 3:] = torch.randn(z[0, 3:].shape, generator=torch.Generator().manual_seed(0))
    body = z.numpy().tobytes()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    query = f"shape={json.dumps(list(z.shape)).replace(' ', '')}&output_type=mp4"
    head = (
        f"POST /decode/faulty-video?{query} HTTP/1.1\r\nHost: x\r\n"
        f"Content-Type: tensor/binary\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    assert sock.recv(12).startswith(b"HTTP/1.1 200")
    return sock


def test_a_stalled_mp4_reader_costs_only_its_own_stream(store):
    # the stalled reader is dropped after stream_stall_s at the latest: 10 s, not the default
    # 60 s, and the other request must be answered well inside it
    settings = dict(stream_buffer_mb=1, stream_wait_s=0.5, stream_stall_s=10)
    with live_server(store, device="cpu", dtype="float32", **settings) as url:
        sock = stalled_mp4_request(url, frames=250)
        try:
            t0 = time.monotonic()
            r = post(url, faulty.latent(tag=79))  # another request, same worker
            waited = time.monotonic() - t0
            assert r.status_code == 200
            assert waited < 5  # not the 10 s stall limit of the stalled reader
            # the other request did not wait for the stalled stream to be dropped (it is served
            # between the stream's chunks); still stalled, the stream is dropped once its
            # buffer is full for VAE_STREAM_WAIT_S, and its ffmpeg reaped
            faulty.wait_for("the stalled stream dropped", lambda: not ffmpeg_children(), 120)
            # the dropped stream ends without its final chunk, or with a reset (a reader that
            # read nothing for the stall limit): the truncation is visible
            sock.settimeout(30)
            received = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(1 << 16):
                    received += chunk
            assert not received.endswith(b"0\r\n\r\n")
        finally:
            sock.close()
        assert len(faulty.decoded(78)) < 250  # the worker stopped decoding it


def test_a_compiled_shape_runs_its_graph_and_other_shapes_run_eagerly(runtime):
    """The runner takes a model's compiled decode for exactly the shapes it was compiled
    for (app/runtime/compiled.py compiles them on a GPU), timed as one ``decode`` phase."""
    served = runtime.models["faulty"]
    calls = []

    def graph(z):
        calls.append(tuple(z.shape))
        return served.fast.decode(z, tiled=False)

    served.compiled[(1, 4, 4, 4)] = graph
    try:
        timer = PhaseTimer()
        runtime.runner.decode(served, DecodeRequest(faulty.latent(tag=96), Output.TENSOR), timer)
        assert calls == [(1, 4, 4, 4)] and "decode" in timer.phases()
        bigger = DecodeRequest(faulty.latent(tag=97, size=8), Output.TENSOR)
        runtime.runner.decode(served, bigger, PhaseTimer())
        assert calls == [(1, 4, 4, 4)]  # another shape: the eager decoder
    finally:
        served.compiled.clear()


def test_the_worker_forms_micro_batches_of_the_rows_the_runner_plans(runtime, monkeypatch):
    """One request of 3 rows, a plan of 2 rows per decode (VAE_MAX_DECODE_MB): the scheduler
    decodes [2, 1] and hands the request all 3 rows, in order."""
    served = runtime.models["faulty"].active
    one = served.planned_bytes((1, 4, 4, 4), next(served.parameters()).element_size())
    monkeypatch.setattr(runner_module.devices, "memory_budget", lambda d, c: 1 << 40)
    monkeypatch.setattr(runtime.runner, "max_planned_bytes", 2 * one)  # two latents' worth
    faulty.BATCHES.clear()
    z = rows((0, 0, 88), (0, 0, 89), (0, 0, 90))
    out = scheduled(runtime, z)
    assert faulty.BATCHES == [2, 1]
    torch.testing.assert_close(out, decode(runtime, z), rtol=0, atol=0)


def test_batch_rows_caps_a_micro_batch_and_its_histogram_counts_them(runtime):
    metrics = Metrics()
    faulty.BATCHES.clear()
    out = scheduled(runtime, rows((0, 0, 151), (0, 0, 152), (0, 0, 153)), 2, metrics)
    assert out.shape[0] == 3 and faulty.BATCHES == [2, 1]
    count = metrics.registry.get_sample_value("vae_batch_rows_count", {"model": "faulty"})
    total = metrics.registry.get_sample_value("vae_batch_rows_sum", {"model": "faulty"})
    assert (count, total) == (2, 3)


def test_a_manifests_max_batch_caps_the_micro_batch_too(runtime):
    """The manifest's max_batch tightens the per-request limit (413) and the worker's row cap
    alike: a 3-row latent of that model is decoded 2 + 1."""
    faulty.BATCHES.clear()
    out = scheduled(runtime, rows((0, 0, 154), (0, 0, 155), (0, 0, 156)), model="faulty-pairs")
    assert out.shape[0] == 3 and faulty.BATCHES == [2, 1]


def test_warm_up_decodes_on_the_decode_worker_thread(store):
    """The first request must not pay for the worker thread's cuDNN handles and algorithm
    search (measured on an H200: 0.5 s on the first request when the warm-up ran elsewhere)."""
    threads = []
    settings = Settings(models_dir=store, device="cpu", dtype="bfloat16", models="faulty")
    runtime = Runtime(settings.model_copy(update={"warmup_shapes": "1x4x4x4"}), Metrics())
    served_decode = faulty.Decoder.decode

    def spy(self, z, **options):
        threads.append(threading.current_thread().name)
        return served_decode(self, z, **options)

    runtime.start()
    try:
        faulty.Decoder.decode = spy
        runtime.load_all()
    finally:
        faulty.Decoder.decode = served_decode
        runtime.stop()
    assert threads and threads[-1] == "decode-worker"


def test_queued_videos_each_get_all_their_frames_streamed(store):
    """Video frames come back flattened into rows ([B*T,...]): each request gets its T. Every
    video answer streams as it decodes (issue 36.8), so queued videos decode one after the
    other, each into its own stream, rather than in one micro-batch."""
    with live_server(store, device="cpu", dtype="float32", batch_rows=4) as url:
        shape = [1, 4, 3, 4, 4]
        worker = threading.Thread(target=post, args=(url, faulty.latent(faulty.HOLD, 0, 99)))
        worker.start()
        faulty.wait_for("the worker held", lambda: faulty.started(99))
        results = {}

        def call(tag: float) -> None:
            results[tag] = requests.post(
                f"{url}/decode/faulty-video",
                data=faulty.latent(tag=tag, frames=3).numpy().tobytes(),
                params={"shape": json.dumps(shape), "output_type": "pil"},
                headers={"Content-Type": "tensor/binary", "Accept": "tensor/binary"},
                timeout=30,
            )

        threads = [threading.Thread(target=call, args=(t,)) for t in (100.0, 101.0)]
        for t in threads:
            t.start()
        faulty.wait_for("both queued", lambda: queue_depth(url) == 2)
        faulty.release(99)
        for t in [worker, *threads]:
            t.join()
        assert faulty.BATCHES[-2:] == [1, 1]  # each its own stream
        for r in results.values():
            assert r.status_code == 200 and json.loads(r.headers["shape"]) == [3, 3, 32, 32]
            assert r.headers["x-frames"] == "3" and "content-length" not in r.headers


def queue_depth(url: str) -> float:
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vae_queue_depth"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _sample(url: str, name: str, **labels: str) -> float:
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_batch_window_fills_a_micro_batch_and_vae_batch_rows_shows_it(store):
    """VAE_BATCH_WINDOW_MS: the worker waits for more requests to fill a micro-batch (up to
    VAE_BATCH_ROWS, then at once); /metrics' vae_batch_rows counts the rows it ran."""
    window_ms = 20_000  # far longer than the test: a full batch must not wait for it
    with live_server(store, device="cpu", dtype="float32", batch_rows=3,
                     batch_window_ms=window_ms, models="faulty") as url:  # fmt: skip
        faulty.BATCHES.clear()
        codes: list[int] = []
        calls = [
            threading.Thread(target=lambda t=t: codes.append(post(url, faulty.latent(tag=t)).status_code))
            for t in (130.0, 131.0, 132.0)
        ]  # fmt: skip
        t0 = time.monotonic()
        for t in calls:
            t.start()
        for t in calls:
            t.join(60)
        elapsed = time.monotonic() - t0
        assert codes == [200, 200, 200]
        assert faulty.BATCHES == [3] and elapsed < window_ms / 1000 / 2, (faulty.BATCHES, elapsed)
        assert _sample(url, "vae_batch_rows_count", model="faulty") == 1
        assert _sample(url, "vae_batch_rows_sum", model="faulty") == 3
        assert _sample(url, "vae_batch_rows_bucket", model="faulty", le="2.0") == 0
        assert _sample(url, "vae_batch_rows_bucket", model="faulty", le="4.0") == 1


def test_a_stop_during_a_batch_window_runs_the_batch_and_ends_the_worker(runtime):
    """The stop sentinel can arrive while the worker waits to fill a micro-batch: the batch
    runs, then the worker exits (it lost the sentinel and waited out the stop's timeout)."""
    scheduler = Scheduler(runtime.runner, Metrics(), 4, 8, lambda r: None, batch_window_s=20)
    scheduler.start()
    job = Job(
        runtime.models["faulty"], DecodeRequest(rows((0, 0, 139)), Output.TENSOR), PhaseTimer()
    )
    scheduler.submit(job)
    faulty.wait_for("the worker waits in its window", scheduler._queue.empty)
    t0 = time.monotonic()
    scheduler.stop(timeout=10)
    assert time.monotonic() - t0 < 5 and not scheduler._worker.is_alive()
    assert job.future.result(timeout=0).shape[0] == 1


def test_a_worker_that_dies_answers_its_jobs_and_asks_to_be_replaced(runtime, monkeypatch):
    """A bug in the worker's own loop (before: an infinite VAE_HEAP_IDLE_S overflowed its
    wait, the thread died, /healthz stayed 200 and every request waited out its deadline):
    the job it held and those queued fail as a lost device would (503), and the process is
    told to go (the service's SIGTERM), so the platform replaces it."""
    lost: list[str] = []
    scheduler = Scheduler(runtime.runner, Metrics(), 4, 8, lost.append, batch_window_s=20)

    def broken(item) -> None:
        raise OverflowError("timestamp out of range for platform time_t")

    monkeypatch.setattr(scheduler, "_run_item", broken)
    jobs = [
        Job(runtime.models["faulty"], DecodeRequest(rows((0, 0, t)), Output.TENSOR), PhaseTimer())
        for t in (140.0, 141.0)
    ]
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    for job in jobs:
        with pytest.raises(DeviceLost, match="the decode worker stopped: OverflowError"):
            job.future.result(timeout=10)
    assert lost and scheduler.worker_died and scheduler.device_lost == lost[0]
    with pytest.raises(DeviceLost):
        scheduler.submit(jobs[0])


def test_a_micro_batch_plans_no_more_memory_than_one_request_may(store):
    """VAE_MAX_DECODE_MB bounds a run, not only a request: on the CPU (no device budget) the
    worker would otherwise batch VAE_BATCH_ROWS requests each at the limit into one decode.
    Each latent here plans 0.56 MiB against 1 MiB: three requests, three runs of one row."""
    with live_server(store, device="cpu", dtype="float32", batch_rows=3, max_decode_mb=1,
                     batch_window_ms=20_000, models="faulty") as url:  # fmt: skip
        faulty.BATCHES.clear()
        codes: list[int] = []
        calls = [
            threading.Thread(target=lambda t=t: codes.append(post(url, faulty.latent(tag=t, size=12)).status_code))
            for t in (134.0, 135.0, 136.0)
        ]  # fmt: skip
        for t in calls:
            t.start()
        for t in calls:
            t.join(60)
        assert codes == [200, 200, 200]
        assert faulty.BATCHES == [1, 1, 1]
        assert _sample(url, "vae_batch_rows_bucket", model="faulty", le="1.0") == 3


def test_without_a_window_the_worker_runs_what_is_queued(store):
    """The default (0 ms): a lone request is decoded at once, in a micro-batch of one."""
    with live_server(store, device="cpu", dtype="float32", models="faulty") as url:
        faulty.BATCHES.clear()
        assert post(url, faulty.latent(tag=133)).status_code == 200
        assert faulty.BATCHES == [1]
        assert _sample(url, "vae_batch_rows_bucket", model="faulty", le="1.0") == 1
