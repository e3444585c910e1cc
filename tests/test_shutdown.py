"""SIGTERM: a real server process drains accepted decodes, refuses new ones, and exits when
the grace runs out, answering every accepted request."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from tests import faulty
from tests.helpers import (
    SERVE_FAULTY,
    faulty_family,
    faulty_server,
    faulty_store,
    post,
    upload_and_read,
    wait_queued,
)

__all__ = ["faulty_family", "faulty_server", "faulty_store"]  # module-scoped fixtures


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
    assert exited - ran_out < 2.0, (ran_out, exited)  # the exit follows the answers (~1 s)
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


def test_a_client_mid_upload_during_the_drain_reads_its_503(store, tmp_path):
    """Issue 25.9: the drain's 503 (+ Retry-After, Connection: close) reaches a client still
    sending its body: the server lingers, reading and dropping the rest, instead of closing
    on unread data (a TCP reset, which can destroy the answer). Then the process exits
    within about a second of the drain's end."""
    codes: list = []
    env = {**SERVE_FAULTY, "VAE_DRAIN_GRACE_S": "120"}
    head = (
        b"POST /decode/faulty?shape=[1,4,4,4]&output_type=pt HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: tensor/binary\r\nContent-Length: %d\r\n\r\n" % (32 << 20)
    )
    with faulty.serve_process(store, tmp_path / "serve.log", True, **env) as (url, proc):
        threads = start_held(url, [141.0], codes)
        proc.send_signal(signal.SIGTERM)
        wait_draining(url)
        answers = [upload_and_read(url, head, 32 << 20) for _ in range(3)]
        faulty.release(141.0)
        for t in threads:
            t.join(30)
        done = time.monotonic()
        rc = proc.wait(30)
        exited = time.monotonic() - done
    for received, error in answers:
        assert error == "" and received.startswith(b"HTTP/1.1 503"), (error, received[:200])
        assert b"retry-after" in received.lower() and b"shutting down" in received
    assert codes == [200] and rc in (0, -signal.SIGTERM)
    print(f"exited {exited:.2f} s after the last answer")
    assert exited < 2.0, exited
