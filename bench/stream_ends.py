"""Stream ends, measured on a real loopback server with the faulty video family (issue 25):
ffmpeg children left after stalled MP4 streams are closed, a slow steady reader's bytes, and
a small decode's queue wait while a video decodes. ``python -m bench.stream_ends``."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

import requests

from tests import faulty
from tests.live import live_server
from tests.mp4_client import RawStream, ffmpeg_children, video_latent


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += faulty.rss_bytes(pid)
        except (OSError, RuntimeError):
            pass
    return total / 2**20


def main() -> None:
    faulty.register()
    store = Path(tempfile.mkdtemp()) / "store"
    faulty.bake(store, "faulty")
    faulty.bake(store, "faulty-video", video=True)
    with live_server(store, device="cpu", dtype="float32", stream_socket_kb=16) as url:
        stalled_then_closed(url)
        small_decode_during_video(url)
    with live_server(store, device="cpu", dtype="float32", stream_stall_s=2.0) as url:
        slow_reader(url)


def stalled_then_closed(url: str) -> None:
    streams = [RawStream(url, video_latent(200 + i, 96, 40)) for i in range(6)]
    for s in streams:
        s.read_head()
    time.sleep(2)
    print(
        f"6 stalled streams: {len(ffmpeg_children())} ffmpeg, {rss_mib(ffmpeg_children()):.0f} MiB"
    )
    for s in streams:
        s.close()
    for wait in (1, 5):
        time.sleep(wait if wait == 1 else 4)
        print(
            f"{wait} s after closing: {len(ffmpeg_children())} ffmpeg, "
            f"{rss_mib(ffmpeg_children()):.0f} MiB"
        )


def slow_reader(url: str) -> None:
    s = RawStream(url, video_latent(220, 48, 40))
    s.read_head()
    started = time.monotonic()
    s.read_paced(8192)
    body, complete = s.body()
    print(
        f"8 KB/s reader, stall 2 s: {len(body)} bytes in "
        f"{time.monotonic() - started:.1f} s, complete={complete}"
    )


def small_decode_during_video(url: str) -> None:
    tag = 230.0
    video = RawStream(url, video_latent(tag, 40, 8, faulty.SLEEP, 0.2))
    video.read_head()
    reader = threading.Thread(target=video.read_paced, args=(1 << 20,))
    reader.start()
    faulty.wait_for("video decoding", lambda: len(faulty.decoded(tag)) >= 2, 30)
    small = faulty.latent(tag=231, size=8)
    t0 = time.monotonic()
    r = requests.post(
        f"{url}/decode/faulty", data=small.numpy().tobytes(),
        params={"shape": json.dumps(list(small.shape)), "output_type": "pil"},
        headers={"Content-Type": "tensor/binary"}, timeout=120,
    )  # fmt: skip
    queue = r.headers["Server-Timing"].split("queue;dur=")[1].split(",")[0]
    print(
        f"64x64 PNG during a 40 x 0.2 s video: {r.status_code} in "
        f"{time.monotonic() - t0:.2f} s, queue {float(queue) / 1000:.2f} s, "
        f"video frames decoded by then {len(faulty.decoded(tag))}/40"
    )
    reader.join(60)


if __name__ == "__main__":
    main()
