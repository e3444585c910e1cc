"""Reliability and security: deadlines, disconnects, body limits, faults, broken stores, auth,
safe headers, drain on SIGTERM. Servers are real uvicorn on loopback, models tiny."""

from __future__ import annotations

import io
import json
import re
import signal
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import imageio_ffmpeg
import numpy as np
import pytest
import requests
import torch
from fastapi.testclient import TestClient

from app.config import Settings
from app.http.decode import deadline
from app.metrics import Metrics
from app.protocol import parse_head
from app.request import DecodeRequest
from app.runtime import Job, Runtime
from app.runtime.channel import FrameChannel
from app.runtime.scheduler import DeadlineExceeded, admit
from app.service import create_app
from app.store import StoreError, check_name, load_model
from tests import faulty
from tests.live import live_server


@pytest.fixture(scope="module", autouse=True)
def faulty_family():
    with faulty.registered():
        yield


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("faulty-store")
    faulty.bake(store, "faulty")
    faulty.bake(store, "faulty-small", max_pixels=32 * 32)  # a manifest that tightens a limit
    faulty.bake(store, "faulty-video", video=True)
    return store


@pytest.fixture(scope="module")
def server(store):
    """bf16 on the CPU: the fast path is a copy, so the CPU path is a real fallback."""
    limits = dict(max_batch=4, batch_rows=4, queue_depth=8, max_body_mb=1, body_timeout_s=1.0)
    with live_server(store, device="cpu", dtype="bfloat16", **limits) as url:
        yield url


def post(url: str, z: torch.Tensor, model: str = "faulty", headers=None, **params):
    return requests.post(
        f"{url}/decode/{model}",
        data=z.numpy().tobytes(),
        params={"shape": json.dumps(list(z.shape)), "output_type": "pt", **params},
        headers={"Content-Type": "tensor/binary", **(headers or {})},
        timeout=30,
    )


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of the exposition (0 when absent)."""
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if not line.startswith((name + "{", name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def occupy(url: str, tag: float) -> threading.Thread:
    """Hold the single worker until ``faulty.release(tag)``; returns the caller's thread once
    the worker has taken the decode (no guess at how long anything takes)."""
    thread = threading.Thread(target=post, args=(url, faulty.latent(faulty.HOLD, tag=tag)))
    thread.start()
    faulty.wait_for(f"the worker took {tag}", lambda: faulty.started(tag))
    return thread


def wait_queued(url: str, n: int) -> None:
    """Wait until ``n`` decodes wait in the queue (the worker is held)."""
    faulty.wait_for(f"{n} queued", lambda: metric(url, "vae_queue_depth") == n)


# --- faults ------------------------------------------------------------------------------


def test_oom_retries_tiled_then_answers_503_and_counts_it(server):
    """The ladder ends on a 503 with Retry-After, not on minutes of float32 CPU decoding."""
    before = metric(server, "vae_retries_total", model="faulty", path="tiled")
    r = post(server, faulty.latent(faulty.OOM_UNTILED, tag=31))
    assert r.status_code == 200, r.text
    r = post(server, faulty.latent(faulty.OOM_FAST, tag=30))
    assert r.status_code == 503 and "out of memory" in r.json()["error"], r.text
    assert int(r.headers["Retry-After"]) >= 1
    assert faulty.decoded(31) == [("tiled", 0)] and ("cpu", 0) not in faulty.decoded(30)
    after = metric(server, "vae_retries_total", model="faulty", path="tiled")
    assert after - before == 2


def test_oom_fallback_cpu_ends_the_ladder_on_the_float32_cpu_path(store):
    with live_server(store, device="cpu", dtype="bfloat16", oom_fallback="cpu") as url:
        r = post(url, faulty.latent(faulty.OOM_FAST, tag=32))
        assert r.status_code == 200, r.text
        assert faulty.decoded(32)[-1] == ("cpu", 0)
        assert metric(url, "vae_retries_total", model="faulty", path="cpu") == 1


def test_oom_on_every_path_is_a_json_503(server):
    r = post(server, faulty.latent(faulty.OOM_ALL))
    assert r.status_code == 503 and "out of memory" in r.json()["error"]
    assert int(r.headers["Retry-After"]) >= 1


def test_a_decoder_crash_fails_only_its_request(server):
    """A crash inside a micro-batch: the batch is split, the others still get their output."""
    worker = occupy(server, tag=50)
    results: dict[float, requests.Response] = {}

    def call(command: float, tag: float) -> None:
        results[tag] = post(server, faulty.latent(command, tag=tag))

    calls = [(faulty.CRASH, 51), (0.0, 52), (0.0, 53), (0.0, 54)]
    threads = [threading.Thread(target=call, args=c) for c in calls]
    for t in threads:
        t.start()
    wait_queued(server, len(calls))  # all four queued: the worker takes them as one batch
    faulty.release(50)
    for t in [worker, *threads]:
        t.join()
    crash = results[51]
    assert crash.status_code == 503, crash.text
    assert "decoder" in crash.json()["error"] and "RuntimeError" in crash.json()["error"]
    assert all(results[t].status_code == 200 for t in (52, 53, 54))
    assert {52, 53, 54} <= set(faulty.decoded_tags())
    assert post(server, faulty.latent(tag=55)).status_code == 200  # the worker goes on


def post_mp4(url: str, z: torch.Tensor, **kwargs) -> requests.Response:
    return requests.post(
        f"{url}/decode/faulty-video",
        data=z.numpy().tobytes(),
        params={"shape": json.dumps(list(z.shape)), "output_type": "mp4"},
        headers={"Content-Type": "tensor/binary", **kwargs.pop("headers", {})},
        timeout=30,
        **kwargs,
    )


def mp4_frames(data: bytes, tmp_path: Path) -> int:
    path = tmp_path / "out.mp4"
    path.write_bytes(data)
    reader = imageio_ffmpeg.read_frames(str(path))
    next(reader)
    return sum(1 for _ in reader)


def test_a_stream_that_fails_before_its_first_frame_is_a_json_503(server):
    r = post_mp4(server, faulty.latent(faulty.CRASH, 0, tag=90, frames=3))
    assert r.status_code == 503 and "RuntimeError" in r.json()["error"]


def test_a_stream_out_of_memory_mid_video_resumes_tiled(server, tmp_path):
    """Frames 0-2 go out from the untiled path; the rest come from the tiled one, none twice."""
    r = post_mp4(server, faulty.latent(faulty.OOM_UNTILED, 3, tag=91, frames=6))
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    assert mp4_frames(r.content, tmp_path) == 6
    served = faulty.decoded(91)
    assert served[:3] == [("fast", 0), ("fast", 1), ("fast", 2)]
    assert served[-3:] == [("tiled", 3), ("tiled", 4), ("tiled", 5)]


def test_a_stream_that_fails_midway_is_aborted_not_ended(server):
    """Frames already sent cannot be taken back: the body is cut (no final chunk), so the
    client sees a truncated response instead of a short but valid MP4."""
    z = faulty.latent(faulty.OOM_ALL, 40, tag=94, frames=60)
    with post_mp4(server, z, stream=True) as r:
        assert r.status_code == 200
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            for _ in r.iter_content(1 << 16):
                pass
    assert post(server, faulty.latent(tag=95)).status_code == 200


def test_a_stream_stops_decoding_when_its_client_leaves(server):
    with post_mp4(server, faulty.latent(faulty.SLEEP, 0.05, tag=92, frames=60), stream=True) as r:
        assert r.status_code == 200
        next(r.iter_content(64))  # the stream is flowing; now hang up
    # one worker: once the next request is decoded, the stream's job has ended
    assert post(server, faulty.latent(tag=93)).status_code == 200
    frames = len(faulty.decoded(92))
    # stopped at once, not when the encoder next wrote (a fragment is 2 s of video: 48 frames)
    assert frames < 20, frames


# --- admission: deadlines and disconnects ------------------------------------------------


def test_a_request_that_cannot_start_by_its_deadline_is_refused_not_decoded(server):
    worker = occupy(server, tag=60)
    try:  # answered while the worker is still held: at the deadline, not when it got to it
        by_header = post(server, faulty.latent(tag=61), headers={"X-Request-Timeout": "0.25"})
        by_param = post(server, faulty.latent(tag=62), timeout="0.2")
        by_stream = post_mp4(
            server, faulty.latent(tag=63, frames=2), headers={"X-Request-Timeout": "0.2"}
        )
    finally:
        faulty.release(60)
    worker.join()
    for r in (by_header, by_param, by_stream):
        assert r.status_code == 503 and "deadline" in r.json()["error"], r.text
        assert int(r.headers["Retry-After"]) >= 1
    assert post(server, faulty.latent(tag=64)).status_code == 200  # the queue behind is done
    assert not {61, 62, 63} & set(faulty.decoded_tags())


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan", "inf"])
def test_a_bad_timeout_is_a_422(server, value):
    r = post(server, faulty.latent(), headers={"X-Request-Timeout": value})
    assert r.status_code == 422 and "X-Request-Timeout" in r.json()["error"]


def test_the_server_caps_the_deadline():
    head = parse_head([], [("x-request-timeout", "1e6")])
    assert deadline(100.0, head, Settings(max_request_timeout_s=5)) == 105.0
    assert deadline(100.0, parse_head([]), Settings(max_request_timeout_s=7)) == 107.0


def test_the_worker_refuses_a_job_whose_deadline_passed():
    request = DecodeRequest(torch.zeros(1), deadline=time.perf_counter() - 1)
    job = Job(None, request, None, FrameChannel(1 << 20, 1.0))
    assert not admit(job, time.perf_counter())
    assert isinstance(job.future.exception(), DeadlineExceeded)
    assert isinstance(job.channel.first.exception(), DeadlineExceeded)


def test_a_client_that_disconnects_while_queued_is_not_decoded(server):
    worker = occupy(server, tag=70)
    gone_before = metric(server, "vae_requests_total", code="499")
    body = faulty.latent(tag=77).numpy().tobytes()
    sock = raw_request(server, "/decode/faulty?shape=[1,4,4,4]&output_type=pt", body)
    try:
        wait_queued(server, 1)  # queued behind the held decode
        sock.close()
        gone = lambda: metric(server, "vae_requests_total", code="499") == gone_before + 1  # noqa: E731
        faulty.wait_for("the 499 is counted", gone)
    finally:
        faulty.release(70)
    worker.join()
    assert post(server, faulty.latent(tag=78)).status_code == 200  # the queue behind is done
    assert 77 not in faulty.decoded_tags()


# --- bodies -------------------------------------------------------------------------------


def raw_request(url: str, target: str, body: bytes = b"", headers: dict | None = None):
    """A hand-made HTTP/1.1 request on a fresh socket (the caller reads or closes it)."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    sock = socket.create_connection((host, port), timeout=10)
    fields = {"Host": f"{host}:{port}", "Content-Type": "tensor/binary"}
    fields |= headers if headers is not None else {"Content-Length": str(len(body))}
    head = f"POST {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    sock.sendall(head.encode() + b"\r\n" + body)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the response on ``sock`` (read until it closes or completes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or b"\r\n\r\n"
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    sock.close()
    return int(head.split()[1]), json.loads(rest[:length])


def test_a_chunked_body_over_the_limit_is_refused_while_it_streams(server):
    sock = raw_request(
        server, "/decode/faulty?shape=[1,4,4,4]", headers={"Transfer-Encoding": "chunked"}
    )
    chunk = b"\0" * 65536
    for _ in range(17):  # 1.06 MiB of a 1 MiB limit; no terminating chunk is ever sent
        sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
    status, body = read_response(sock)
    assert status == 413 and "limit" in body["error"]


def test_a_declared_oversize_body_is_refused_before_it_is_sent(server):
    sock = raw_request(
        server, "/decode/faulty?shape=[1,4,4,4]", headers={"Content-Length": "5000000"}
    )
    assert read_response(sock)[0] == 413  # no body byte was sent
    target = "/decode/faulty?shape=[1,4,1024,1024]"
    sock = raw_request(server, target, headers={"Transfer-Encoding": "chunked"})
    status, body = read_response(sock)
    assert status == 413 and "shape" in body["error"]


def test_a_body_that_trickles_in_times_out_with_408(server):
    sock = raw_request(server, "/decode/faulty?shape=[1,4,4,4]", headers={"Content-Length": "256"})
    sock.sendall(b"\0" * 10)
    t0 = time.perf_counter()
    status, body = read_response(sock)
    assert status == 408 and "did not arrive" in body["error"]
    assert time.perf_counter() - t0 < 5


def test_per_model_limits_come_from_the_manifest(server):
    big = faulty.latent(size=8)  # 64x64 output pixels
    assert post(server, big, model="faulty").status_code == 200
    r = post(server, big, model="faulty-small")
    assert r.status_code == 413 and "1024 pixels" in r.json()["error"]
    assert post(server, faulty.latent(size=4), model="faulty-small").status_code == 200


def test_a_pickled_npy_body_is_refused_unread(server, tmp_path):
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    buf = io.BytesIO()
    np.save(buf, np.array([Payload()], dtype=object), allow_pickle=True)
    r = requests.post(
        f"{server}/decode/faulty",
        data=buf.getvalue(),
        headers={"Content-Type": "application/x-npy"},
        timeout=10,
    )
    assert r.status_code == 422 and "dtype" in r.json()["error"]
    assert not marker.exists()


def test_no_pickle_on_the_request_or_load_path():
    """Only safetensors and header-checked .npy are read; ``torch.load`` only at import."""
    app = Path(__file__).resolve().parents[1] / "app"
    for path in app.rglob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "allow_pickle=True" not in text, path
        assert "np.load(" not in text, path
        for call in _calls(text, "torch.load("):
            assert "weights_only=True" in call, (path, call)


def _calls(text: str, opening: str) -> list[str]:
    """The full text of each call ``opening...)``, nested parentheses included."""
    calls = []
    for match in re.finditer(re.escape(opening), text):
        depth, end = 0, match.start()
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        calls.append(text[match.start() : end + 1])
    return calls


# --- broken stores -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broken_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("broken-store")
    for name in ("good", "truncated", "noweights", "badsha", "garbled"):
        faulty.bake(store, name)
    weights = lambda name: store / name / "decoder.safetensors"  # noqa: E731
    weights("truncated").write_bytes(weights("truncated").read_bytes()[:40])
    weights("noweights").unlink()
    data = bytearray(weights("badsha").read_bytes())
    data[-1] ^= 0x40  # still a valid safetensors file: only the hash can tell
    weights("badsha").write_bytes(bytes(data))
    (store / "garbled" / "manifest.json").write_text("{not json")
    return store


BROKEN = {
    "truncated": "sha256",
    "noweights": "missing",
    "badsha": "sha256",
    "garbled": "manifest",
    "absent": "manifest",
    "../etc": "invalid model name",
}


def test_broken_models_are_named_and_the_others_serve(broken_store):
    names = ",".join(["good", *BROKEN])
    with live_server(broken_store, dtype="float32", models=names) as url:
        ready = requests.get(f"{url}/readyz", timeout=10)
        assert ready.status_code == 503
        errors = ready.json()["errors"]
        for name, words in BROKEN.items():
            assert words in errors[name] and name in ready.json()["reason"], (name, errors)
        assert ready.json()["models"] == ["good"]
        assert post(url, faulty.latent(), model="good").status_code == 200
        r = post(url, faulty.latent(), model="truncated")
        assert r.status_code == 503 and "truncated" in r.json()["error"]


def test_without_hash_checks_corruption_is_still_named_and_ready_can_be_partial(broken_store):
    settings = dict(dtype="float32", ready_partial=True, verify_weights=False)
    runtime = Runtime(Settings(models_dir=broken_store, **settings), Metrics())
    runtime.load_all()
    assert runtime.ready and set(runtime.models) == {"good", "badsha"}
    assert set(runtime.errors) == {"truncated", "noweights", "garbled"}
    assert "cannot load" in runtime.errors["truncated"]


# --- security -------------------------------------------------------------------------------


def client(tmp_path, **settings) -> TestClient:
    """The app without its lifespan: routes and middleware, no models loaded."""
    return TestClient(create_app(Settings(models_dir=tmp_path, **settings)))


def test_bearer_tokens_guard_everything_but_health(tmp_path):
    c = client(tmp_path, api_tokens="alpha, beta")
    assert c.get("/healthz").status_code == 200
    assert c.get("/readyz").status_code == 503  # not loaded, but not a 401
    assert c.get("/metrics").status_code == 200
    for path in ("/models", "/openapi.json", "/docs"):
        r = c.get(path)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == 'Bearer realm="vae"'
        assert r.json()["error"] == "missing bearer token" and "X-Request-Id" in r.headers
    r = c.post("/decode/good", content=b"\0" * 64, headers={"Authorization": "Bearer gamma"})
    assert r.status_code == 401 and 'error="invalid_token"' in r.headers["WWW-Authenticate"]
    assert c.get("/models", headers={"Authorization": "Basic YWxwaGE6"}).status_code == 401
    for header in ("Bearer beta", "bearer alpha", "Bearer  alpha "):
        assert c.get("/models", headers={"Authorization": header}).status_code == 200, header


def test_metrics_can_be_protected(tmp_path):
    c = client(tmp_path, api_tokens="alpha", protect_metrics=True)
    assert c.get("/metrics").status_code == 401
    assert c.get("/metrics", headers={"Authorization": "Bearer alpha"}).status_code == 200
    assert c.get("/healthz").status_code == 200


def test_no_tokens_means_no_auth(tmp_path):
    assert client(tmp_path).get("/models").status_code == 200


def test_responses_carry_safe_headers(tmp_path):
    c = client(tmp_path)
    for r in (c.get("/healthz"), c.get("/nope"), c.delete("/models"), c.post("/decode/x")):
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["X-Frame-Options"] == "DENY"
        assert r.headers["Referrer-Policy"] == "no-referrer"
        assert r.headers["Cache-Control"] == "no-store"
        assert "default-src 'none'" in r.headers["Content-Security-Policy"]
        assert r.headers["content-type"].startswith("application/json")
    assert "Content-Security-Policy" not in c.get("/docs").headers  # Swagger UI needs scripts


TRAVERSALS = [
    "/decode/..%2F..%2Fetc%2Fpasswd",
    "/decode/%2e%2e",
    "/decode/.env",
    "/decode/a%00b",
    "/decode/" + "a" * 80,
    "/decode?model=../../etc/passwd",
    "/decode?model=%2Fetc%2Fpasswd",
    "/decode?model=..",
]


@pytest.mark.parametrize("target", TRAVERSALS)
def test_model_names_cannot_walk_out_of_the_store(tmp_path, target):
    target += ("&" if "?" in target else "?") + "shape=[1,4,2,2]"
    r = client(tmp_path).post(target, content=b"\0" * 64)
    assert r.status_code == 404 and "error" in r.json(), r.text


@pytest.mark.parametrize("name", ["..", "../x", "a/b", "", ".x", "a" * 65, "a\0b", "a\\b"])
def test_the_store_refuses_names_that_are_not_plain(tmp_path, name):
    with pytest.raises(StoreError):
        check_name(name)
    with pytest.raises(StoreError):
        load_model(tmp_path, name)


def test_user_input_never_becomes_a_log_format_string(tmp_path, caplog):
    hostile = "%s%d%(boom)s%n"
    with caplog.at_level("INFO"):
        client(tmp_path).post(
            "/decode/x%25s", params={"model": hostile}, headers={"User-Agent": hostile}
        )
    records = [r for r in caplog.records if r.name.startswith("app")]
    assert records
    for record in records:
        assert hostile not in str(record.msg)
        record.getMessage()  # formats: the input only ever travels as an argument


# --- drain on SIGTERM (a real server process, its decodes held and released by the test) ---


def start_held(url: str, tags: list[float], codes: list) -> list[threading.Thread]:
    """One HOLD decode per tag, concurrently; returns once one is decoding and the rest are
    queued. Each call appends its status (or the exception's name) to ``codes``."""

    def call(tag: float) -> None:
        try:
            codes.append(post(url, faulty.latent(faulty.HOLD, tag=tag)).status_code)
        except requests.RequestException as exc:
            codes.append(type(exc).__name__)

    threads = [threading.Thread(target=call, args=(tag,)) for tag in tags]
    for t in threads:
        t.start()
    faulty.wait_for("one decoding", lambda: any(faulty.started(t) for t in tags))
    wait_queued(url, len(tags) - 1)
    return threads


def wait_draining(url: str) -> requests.Response:
    """/readyz once the server has taken the SIGTERM."""
    answers: list[requests.Response] = []

    def draining() -> bool:
        answers.append(requests.get(f"{url}/readyz", timeout=10))
        return answers[-1].status_code == 503

    faulty.wait_for("draining", draining)
    return answers[-1]


SERVE_FAULTY = {"VAE_BATCH_ROWS": "1", "VAE_MODELS": "faulty"}


def test_sigterm_drains_queued_work_and_refuses_new(store, tmp_path):
    grace = 120.0  # longer than the test: the drain ends when the work does, not at the grace
    tags = [101.0 + i for i in range(8)]
    codes: list = []
    env = {**SERVE_FAULTY, "VAE_DRAIN_GRACE_S": str(grace)}
    with faulty.serve_process(store, tmp_path / "serve.log", True, **env) as (url, proc):
        threads = start_held(url, tags, codes)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        ready = wait_draining(url)
        refused = post(url, faulty.latent(tag=109))
        faulty.release(*tags)
        for t in threads:
            t.join(30)
        rc = proc.wait(30)
        elapsed = time.monotonic() - t0
    log = (tmp_path / "serve.log").read_text()
    assert codes == [200] * 8, (codes, log[-2000:])
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
    assert "shutting down" in refused.json()["error"]
    assert refused.headers["Connection"] == "close"
    assert ready.status_code == 503 and "draining" in ready.json()["reason"]
    assert rc in (0, -signal.SIGTERM), log[-2000:]
    assert "grace ran out" not in log and elapsed < grace, elapsed
    assert 109 not in faulty.decoded_tags()


def test_sigterm_exits_when_the_grace_runs_out(store, tmp_path):
    """One request done before the SIGTERM, one held past the grace, two queued behind it."""
    grace = 0.5
    tags = [111.0, 112.0, 113.0, 114.0]
    codes: list = []
    env = {**SERVE_FAULTY, "VAE_DRAIN_GRACE_S": str(grace)}
    log = tmp_path / "serve.log"
    with faulty.serve_process(store, log, True, **env) as (url, proc):
        threads = start_held(url, tags, codes)
        first = next(t for t in tags if faulty.started(t))
        faulty.release(first)
        faulty.wait_for("the first answered", lambda: codes == [200])
        faulty.wait_for("the next one held", lambda: sum(map(faulty.started, tags)) == 2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            faulty.wait_for("grace ran out", lambda: "drain grace ran out" in log.read_text())
            ran_out = time.monotonic() - t0
            rc = proc.wait(30)
            exited = time.monotonic() - t0
        finally:
            faulty.release(*tags)
        for t in threads:
            t.join(30)
    text = log.read_text()
    print(f"grace {grace} s: ran out after {ran_out:.2f} s, exited after {exited:.2f} s, "
          f"rc {rc}, answers {codes}")  # fmt: skip
    assert rc in (0, -signal.SIGTERM), text[-2000:]
    assert grace <= ran_out, ran_out  # it waited the grace for the held decode
    assert len(codes) == 4 and codes[0] == 200 and 200 not in codes[1:], codes


@pytest.fixture(scope="module")
def faulty_process_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("drain-faulty-store")
    faulty.bake(store, "faulty")
    return store


def queue_depth(url: str) -> float:
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vae_queue_depth"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_sigterm_answers_every_accepted_request_when_the_grace_runs_out(
    faulty_process_store, tmp_path
):
    """10 decodes of 1.5 s each, a 2 s grace: those that cannot finish get 503 + Retry-After
    (none is cut off unanswered), and so do requests sent after the SIGTERM."""
    grace, n = 2.0, 10
    env = {"VAE_DRAIN_GRACE_S": str(grace), "VAE_BATCH_ROWS": "1", "VAE_QUEUE_DEPTH": "16"}
    answers: list = []

    def call(tag: float) -> None:
        z = faulty.latent(faulty.SLEEP, 1.5, tag)
        try:
            r = post(url, z)
            answers.append((r.status_code, r.headers.get("Retry-After"), r.text[:200]))
        except requests.RequestException as exc:
            answers.append((type(exc).__name__, None, ""))

    log = tmp_path / "serve.log"
    with faulty.serve_process(faulty_process_store, log, faulty_family=True, **env) as (url, proc):
        threads = [threading.Thread(target=call, args=(float(i),)) for i in range(n)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while queue_depth(url) < n - 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # all accepted: one decoding, the rest queued
        assert queue_depth(url) == n - 1
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        late = [post(url, faulty.latent(tag=99.0)) for _ in range(2)]
        for t in threads:
            t.join(30)
        rc = proc.wait(grace + 10)
    text = log.read_text()
    codes = [code for code, _, _ in answers]
    assert len(answers) == n and set(codes) <= {200, 503}, (answers, text[-2000:])
    assert 503 in codes, answers  # the grace cannot hold 15 s of decodes
    assert all(int(retry) >= 1 for code, retry, _ in answers if code == 503), answers
    assert all("shutting down" in body for code, _, body in answers if code == 503), answers
    assert [r.status_code for r in late] == [503, 503]
    assert all(r.headers["Connection"] == "close" for r in late)
    assert rc in (0, -signal.SIGTERM), text[-2000:]


# --- the client address (X-Forwarded-For from trusted proxies only) ----------------------


@pytest.mark.parametrize("trusted, logged", [
    ("127.0.0.1", "203.0.113.7"),  # the test is the trusted proxy: its header names the client
    ("10.9.9.9", "127.0.0.1"),     # an untrusted peer's header is ignored: a client cannot forge it
])  # fmt: skip
def test_the_client_address_comes_from_x_forwarded_for_of_trusted_proxies_only(
    store, tmp_path, trusted, logged
):
    log = tmp_path / "serve.log"
    env = {**SERVE_FAULTY, "VAE_LOG_FORMAT": "json", "VAE_FORWARDED_ALLOW_IPS": trusted}
    with faulty.serve_process(store, log, True, **env) as (url, _):
        r = post(url, faulty.latent(tag=120), headers={"X-Forwarded-For": "203.0.113.7"})
        assert r.status_code == 200
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    (request,) = [e for e in lines if e.get("httpRequest", {}).get("status") == 200]
    assert request["httpRequest"]["remoteIp"] == logged, request
