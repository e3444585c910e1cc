"""Decode faults on a real server: out of memory (the tiled retry, the CPU fallback, the
JSON 503), a crashing decoder, and streams that fail before, during or after their first frame."""

from __future__ import annotations

import threading
from pathlib import Path

import imageio_ffmpeg
import pytest
import requests

from tests import faulty
from tests.helpers import (
    faulty_family,
    faulty_server,
    faulty_store,
    metric,
    occupy,
    post,
    post_mp4,
    wait_queued,
)
from tests.live import live_server

__all__ = ["faulty_family", "faulty_server", "faulty_store"]  # module-scoped fixtures


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
