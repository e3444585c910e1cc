"""Deadlines and disconnects: a request that cannot start in time is refused, not decoded;
one whose client left while queued is dropped."""

from __future__ import annotations

import time

import pytest
import torch

from app.config import Settings
from app.http.decode import deadline
from app.protocol import parse_head
from app.protocol.request import DecodeRequest
from app.runtime import Job
from app.runtime.channel import FrameChannel
from app.runtime.scheduler import DeadlineExceeded, admit
from tests import faulty
from tests.helpers import (
    faulty_family,
    faulty_server,
    faulty_store,
    metric,
    occupy,
    post,
    post_mp4,
    raw_request,
    wait_queued,
)

__all__ = ["faulty_family", "faulty_server", "faulty_store"]  # module-scoped fixtures


# --- admission: deadlines and disconnects ------------------------------------------------


def test_a_request_that_cannot_start_by_its_deadline_is_refused_not_decoded(server):
    worker = occupy(server, tag=60)
    try:  # answered while the worker is still held: at the deadline, not when it got to it
        by_header = post(server, faulty.latent(tag=61), headers={"X-Request-Timeout": "0.25"})
        by_param = post(server, faulty.latent(tag=62), timeout="0.2")
        by_stream = post_mp4(
            server, faulty.latent(tag=63, frames=2), headers={"X-Request-Timeout": "0.2"}
        )
        assert metric(server, "vae_queue_depth") == 0  # refused jobs left the queue at once
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
        # out of the queue at once (its slot and its input free), not when the worker gets to it
        assert metric(server, "vae_queue_depth") == 0
    finally:
        faulty.release(70)
    worker.join()
    assert post(server, faulty.latent(tag=78)).status_code == 200  # the queue behind is done
    assert 77 not in faulty.decoded_tags()
