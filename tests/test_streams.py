"""MP4 streams end cleanly and fairly: every end reaps its ffmpeg, the streams have a total cap,
a slow but steady reader gets its whole video while one that stops is dropped with one warning
line, and a small decode is answered while a video decodes. Real uvicorn on loopback, real
ffmpeg, raw sockets for the readers (their receive buffer and pace are the test's to set)."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path

import imageio_ffmpeg
import pytest
import requests
import torch

from app.runtime.channel import FrameChannel
from tests import faulty
from tests.helpers import metric
from tests.live import live_server
from tests.mp4_client import RawStream, ffmpeg_children, video_latent

STALL_S = 2.0


@pytest.fixture(scope="module", autouse=True)
def faulty_family():
    with faulty.registered():
        yield


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("streams-store")
    faulty.bake(store, "faulty")
    faulty.bake(store, "faulty-video", video=True)
    return store


@pytest.fixture(scope="module")
def server(store):
    settings = dict(device="cpu", dtype="float32", stream_stall_s=STALL_S, streams_max=3)
    with live_server(store, stream_socket_kb=16, **settings) as url:
        yield url


def mp4_frames(data: bytes, tmp_path: Path) -> int:
    path = tmp_path / "got.mp4"
    path.write_bytes(data)
    reader = imageio_ffmpeg.read_frames(str(path))
    next(reader)
    return sum(1 for _ in reader)


def wait_gone(timeout: float) -> float:
    """Seconds until no ffmpeg child is left (fails past ``timeout``)."""
    start = time.monotonic()
    faulty.wait_for("every ffmpeg reaped", lambda: not ffmpeg_children(), timeout)
    return time.monotonic() - start


# --- a stream's slot is given back exactly once, however it ends --------------------------


def channel() -> tuple[FrameChannel, list[int]]:
    ch, freed = FrameChannel(1 << 20, 0.2), []
    ch.on_free = lambda: freed.append(1)
    return ch, freed


def test_a_slot_is_held_until_the_worker_and_the_reader_are_both_done():
    ch, freed = channel()
    assert ch.put(torch.zeros(1, 3, 1, 2, 2))
    ch.attach_reader()
    ch.close()
    assert freed == []  # the response still encodes and sends the buffered frames
    ch.reader_done()
    ch.reader_done()
    assert freed == [1]


def test_a_slot_is_free_at_once_when_no_reader_will_come():
    ch, freed = channel()  # refused before it started (deadline, client gone, queue full)
    ch.close()
    assert freed == [1]
    ch, freed = channel()  # failed before its first frame: the answer is JSON
    ch.close(RuntimeError("decoder fault"))
    assert freed == [1]
    ch, freed = channel()  # frames came, but the client left before its response started
    assert ch.put(torch.zeros(1, 3, 1, 2, 2))
    ch.drop("the client went away")
    assert freed == []  # the worker may still be decoding
    ch.close()
    assert freed == [1]


def test_a_full_channel_lets_the_worker_do_other_work_and_drops_a_reader_that_takes_nothing():
    ch, _ = channel()
    ch.max_bytes = 1
    assert ch.put(torch.zeros(1, 3, 1, 2, 2))
    calls = []
    assert not ch.put(torch.zeros(1, 3, 1, 2, 2), idle=lambda: calls.append(1) or False)
    assert calls and "took nothing" in ch.dropped


# --- every end reaps its encoder, and the streams are capped ------------------------------


def test_streams_closed_by_their_clients_reap_their_ffmpeg_within_a_second(server):
    streams = [RawStream(server, video_latent(100 + i, 48, 40)) for i in range(3)]
    for s in streams:
        assert s.read_head()[0] == 200  # each has its first frames: its ffmpeg runs
    faulty.wait_for("3 encoders", lambda: len(ffmpeg_children()) == 3, 30)
    time.sleep(0.5)  # stalled: nothing read, the encoders blocked on full pipes
    assert len(ffmpeg_children()) == 3
    for s in streams:
        s.close()
    assert wait_gone(5) <= 1.0


def test_past_the_stream_cap_a_new_stream_gets_429_and_a_freed_slot_is_reused(server):
    streams = [RawStream(server, video_latent(110 + i, 48, 40)) for i in range(3)]
    try:
        assert all(s.read_head()[0] == 200 for s in streams)
        refused = RawStream(server, video_latent(113, 4, 8))
        status, headers = refused.read_head()
        while len(refused.raw.split(b"\r\n\r\n", 1)[1]) < int(headers["content-length"]):
            assert refused.read(4096, timeout=5)
        assert status == 429 and headers["retry-after"] == "1"
        assert headers["content-type"] == "application/json"
        error = json.loads(refused.raw.split(b"\r\n\r\n", 1)[1])["error"]
        assert (
            error == "the streamed answers' cap is reached: 3 streams are running (the most is 3)"
        )
        refused.close()
    finally:
        for s in streams:
            s.close()
    wait_gone(5)
    faulty.wait_for("the closed streams' slots given back", lambda: admitted(server), 10)


def admitted(url: str) -> bool:
    """Whether a new (tiny) stream is admitted, read to its end."""
    s = RawStream(url, video_latent(114, 4, 8))
    try:
        if s.read_head()[0] != 200:
            return False
        s.read_paced(1 << 20)
        assert s.body()[1]
        return True
    finally:
        s.close()


# --- the stall rule is about progress -------------------------------------------------------


def test_a_steady_slow_reader_gets_the_whole_mp4(server, tmp_path):
    """8 KB/s: one send waits on it for seconds (the asyncio buffer drains 48 KB before the
    next write), far past the 2 s stall limit, but its TCP acknowledges bytes all along."""
    s = RawStream(server, video_latent(120, 48, 40), request_id="steady-reader")
    assert s.read_head()[0] == 200
    started = time.monotonic()
    s.read_paced(8192)
    body, complete = s.body()
    took = time.monotonic() - started
    assert complete, f"cut after {len(body)} bytes in {took:.1f} s"
    assert len(body) > 100_000 and took > 3 * STALL_S  # slow enough to matter
    assert mp4_frames(body, tmp_path) == 48


def test_a_reader_that_stops_is_dropped_with_one_warning_and_its_ffmpeg_reaped(server, caplog):
    caplog.set_level(logging.INFO)
    s = RawStream(server, video_latent(121, 96, 40), request_id="stopped-reader")
    assert s.read_head()[0] == 200
    faulty.wait_for("its encoder", lambda: len(ffmpeg_children()) == 1, 30)
    faulty.wait_for("the drop", lambda: not ffmpeg_children(), STALL_S + 10)
    s.read_paced(1 << 20)  # what the kernel still held, then the end: no terminating chunk
    body, complete = s.body()
    assert not complete
    s.close()
    ours = [r for r in caplog.records if "stopped-reader" in r.getMessage()]
    warned = [r for r in ours if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING, ours
    assert "read nothing" in warned[0].getMessage()
    # besides it, only the request's own line (one per request, with its id, at INFO)
    others = [r for r in ours if r is not warned[0]]
    assert [(r.name, r.levelno) for r in others] == [("app.protocol.request", logging.INFO)], ours
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


# --- no head-of-line blocking -------------------------------------------------------------


def test_a_small_decode_is_answered_between_the_chunks_of_a_running_video(server):
    """A video of 40 chunks at 0.2 s each is decoding; a 64x64 image sent meanwhile waits for
    about one chunk, not for the whole video."""
    frames, tag = 40, 130.0
    z = video_latent(tag, frames, 8, faulty.SLEEP, 0.2)
    s = RawStream(server, z)
    reader = threading.Thread(target=s.read_paced, args=(1 << 20,))
    try:
        assert s.read_head()[0] == 200
        reader.start()
        faulty.wait_for("the video decoding", lambda: len(faulty.decoded(tag)) >= 2, 30)
        small = faulty.latent(tag=131, size=8)
        r = requests.post(
            f"{server}/decode/faulty",
            data=small.numpy().tobytes(),
            params={"shape": json.dumps(list(small.shape)), "output_type": "pil"},
            headers={"Content-Type": "tensor/binary"},
            timeout=60,
        )
        video_frames_then = len(faulty.decoded(tag))
        assert r.status_code == 200
        assert video_frames_then < frames, "the image waited for the whole video"
        queued = float(r.headers["Server-Timing"].split("queue;dur=")[1].split(",")[0]) / 1000
        assert queued < 0.2 * 10, queued  # about one chunk; generous for a loaded host
    finally:
        reader.join(60)
        s.close()
    assert s.body()[1] and len(faulty.decoded(tag)) == frames


def test_a_stream_whose_client_left_while_waiting_its_turn_frees_its_slot_at_once(server):
    """Streams queued while a video runs are taken off the queue between its chunks to wait
    their turn; one whose client leaves there gives its stream slot back at once, not when
    the running video ends."""
    tag = 140.0
    running = RawStream(server, video_latent(tag, 40, 8, faulty.SLEEP, 0.2))  # 8 s of chunks
    reader = threading.Thread(target=running.read_paced, args=(1 << 20,))
    try:
        assert running.read_head()[0] == 200
        reader.start()
        waiting = [RawStream(server, video_latent(141 + i, 4, 8)) for i in range(2)]
        faulty.wait_for("two streams waiting", lambda: metric(server, "vae_queue_depth") == 2)
        at = len(faulty.decoded(tag))  # a chunk later they wait their turn off the queue
        faulty.wait_for("two chunks more", lambda: len(faulty.decoded(tag)) >= at + 2)
        for s in waiting:
            s.close()
        done = lambda: len(faulty.decoded(tag)) == 40  # noqa: E731
        faulty.wait_for("both gone", lambda: metric(server, "vae_queue_depth") == 0 or done())
        assert not done(), "the streams whose clients left waited until the video ended"
        # both slots are free while the video runs: one more stream (the cap is 3) is admitted
        # and waits, until its deadline
        late = video_latent(143, 4, 8)
        r = requests.post(
            f"{server}/decode/faulty-video",
            data=late.numpy().tobytes(),
            params={"shape": json.dumps(list(late.shape)), "output_type": "mp4"},
            headers={"Content-Type": "tensor/binary", "X-Request-Timeout": "0.5"},
            timeout=30,
        )
        assert not done(), "the video ended first: nothing was tested"
        assert r.status_code == 503 and "deadline" in r.json()["error"], r.text
    finally:
        reader.join(60)
        running.close()
    assert running.body()[1] and not {141, 142, 143} & set(faulty.decoded_tags())


# --- the streams' total is capped -----------------------------------------------------------


def pss_bytes(pid: int) -> int:
    """Proportional set size of a process (Linux): its private pages, plus each page it
    shares divided by the processes sharing it. Summed over processes it is the memory they
    take together; their RSS would count ffmpeg's shared code once per ffmpeg."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss")


def process_tree_pss(pid: int) -> dict[str, int]:
    """PSS bytes of a server (``server``), of its ffmpeg children together (``ffmpeg``), and
    how many of them there are (``encoders``)."""
    tree = {"server": pss_bytes(pid), "ffmpeg": 0, "encoders": 0}
    for child in encoder_pids(pid):
        try:
            tree["ffmpeg"] += pss_bytes(child)
            tree["encoders"] += 1
        except (OSError, RuntimeError):  # it ended meanwhile
            continue
    return tree


def test_24_slow_streams_stay_under_the_cap_of_the_streams_memory(store, tmp_path):
    """24 clients open a 96-frame 320x320 MP4 each (30 MB of frames) and read nothing for now:
    8 are admitted, 16 get a JSON 429. Each admitted stream holds at most its frame buffer
    (``VAE_STREAM_BUFFER_MB``, 16 MB here: the worker then waits on the reader, for
    ``VAE_STREAM_WAIT_S``) and its ffmpeg (about 25 MB of its own): the server and its
    children together stay under base + 8 x 100 MB. A server started as a fresh process, as
    in production (a forked one shares its parent's pages)."""
    env = {
        "VAE_STREAMS_MAX": "8",
        "VAE_STREAM_SOCKET_KB": "16",
        "VAE_STREAM_BUFFER_MB": "16",
        "VAE_STREAM_WAIT_S": "60",
    }
    serving = faulty.serve_process(store, tmp_path / "log", faulty_family=True, fork=False, **env)
    with serving as (url, proc):
        base = process_tree_pss(proc.pid)
        streams = [RawStream(url, video_latent(400 + i, 96, 40)) for i in range(24)]
        try:
            codes = [s.read_head()[0] for s in streams]
            assert codes.count(200) == 8 and codes.count(429) == 16, codes
            faulty.wait_for("8 encoders", lambda: process_tree_pss(proc.pid)["encoders"] == 8, 60)
            time.sleep(2)  # the admitted streams' frames and encoders are all in memory now
            now = process_tree_pss(proc.pid)
            summary = {k: v if k == "encoders" else f"{v / 2**20:.0f} MiB" for k, v in now.items()}
            print(f"base {base['server'] / 2**20:.0f} MiB, 24 streams: {summary}")
            assert now["encoders"] == 8
            grown = now["server"] + now["ffmpeg"] - base["server"]
            assert grown < 8 * 100 * 2**20, (f"{grown / 2**20:.0f} MiB more", summary)
        finally:
            for s in streams:
                s.close()
        faulty.wait_for("the encoders reaped", lambda: not encoder_pids(proc.pid), 5)


def encoder_pids(server_pid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if "(ffmpeg" in stat and int(stat[stat.rindex(")") + 2 :].split()[1]) == server_pid:
            pids.append(int(entry.name))
    return pids


def test_a_stream_closed_midway_never_ends_its_body_cleanly():
    """``Mp4Stream.close`` (a shutdown's cut) while the response waits for more bytes: the
    body must end with ``StreamAborted`` (the server then leaves out the terminating chunk),
    not as if the MP4 were whole."""
    import asyncio

    from app.http.mp4 import JobStream
    from app.http.streams import Mp4Stream, StreamAborted
    from app.runtime.channel import FrameChannel
    from app.runtime.scheduler import Job
    from app.telemetry.timing import PhaseTimer

    channel = FrameChannel(1 << 30, 30.0)
    job = Job(part=None, request=None, timer=PhaseTimer(), channel=channel)
    frames = torch.randint(0, 255, (48, 64, 64, 3), dtype=torch.uint8)
    channel.put(frames)  # the decode goes on: the channel is never closed
    response = JobStream(Mp4Stream(job, 24.0))

    async def read() -> tuple[int, BaseException | None]:
        body = response.body_iterator.__aiter__()
        sent = len(await body.__anext__())
        response.stream.close("shutting down")
        try:
            async for chunk in body:
                sent += len(chunk)
        except StreamAborted as exc:
            return sent, exc
        return sent, None

    sent, error = asyncio.run(read())
    assert sent > 0 and isinstance(error, StreamAborted), sent
    assert not ffmpeg_children()


def test_a_shutdown_ends_the_stalled_streams_encoders(store, tmp_path):
    """SIGTERM while two streams stall: once the drain grace runs out and the process exits,
    none of their ffmpeg is left running (orphaned to init)."""
    env = {"VAE_DRAIN_GRACE_S": "1", "VAE_STREAM_SOCKET_KB": "16"}
    with faulty.serve_process(store, tmp_path / "log", faulty_family=True, **env) as (url, proc):
        streams = [RawStream(url, video_latent(500 + i, 96, 40)) for i in range(2)]
        try:
            assert [s.read_head()[0] for s in streams] == [200, 200]
            faulty.wait_for("2 encoders", lambda: len(encoder_pids(proc.pid)) == 2, 60)
            pids = encoder_pids(proc.pid)
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
            assert not alive, (proc.returncode, (tmp_path / "log").read_text()[-600:])
        finally:
            for s in streams:
                s.close()
