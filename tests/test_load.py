"""A bounded load test on loopback: 64 concurrent clients against a real `python -m app serve`.

Asserts: zero 5xx, zero lost (every request gets an answer, every 200 a whole body), shed
requests answered 429/503 with Retry-After, and the server's memory back near its baseline.
Prints the numbers (``pytest -s``): requests/s held, p50/p99 latency, shed count.
"""

from __future__ import annotations

import random
import re
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import requests

from tests import faulty
from tests.live import TINY_FLUX, bake

CLIENTS, PER_CLIENT = 64, 5
SHAPE = (1, 16, 4, 4)  # 32x32 output: tiny, so the test measures the serving path
LATENT = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32).tobytes()
PT_BYTES = 1 * 3 * 32 * 32 * 4


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    codes: dict[int, int] = field(default_factory=dict)
    shed_without_retry_after: int = 0
    short_bodies: int = 0
    lost: list[str] = field(default_factory=list)  # exceptions: no answer at all
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, r: requests.Response, output: str, seconds: float) -> None:
        with self.lock:
            self.codes[r.status_code] = self.codes.get(r.status_code, 0) + 1
            if r.status_code == 200:
                self.latencies.append(seconds)
                png = r.content[:4] == b"\x89PNG"
                self.short_bodies += not (len(r.content) == PT_BYTES if output == "pt" else png)
            elif r.status_code in (429, 503):
                self.shed_without_retry_after += "Retry-After" not in r.headers


def one_client(url: str, tally: Tally, n: int, seed: int) -> None:
    """``n`` decodes on one keep-alive connection; a shed one is not retried (it is counted)."""
    rng, session = random.Random(seed), requests.Session()
    for i in range(n):
        output = "pt" if (i + seed) % 2 else "pil"  # raw tensors and PNGs
        params = {"shape": "[1,16,4,4]", "output_type": output}
        t0 = time.perf_counter()
        try:
            r = session.post(f"{url}/decode/flux-tiny", data=LATENT, params=params, timeout=60)
        except requests.RequestException as exc:
            with tally.lock:
                tally.lost.append(type(exc).__name__)
            continue
        tally.record(r, output, time.perf_counter() - t0)
        if r.status_code in (429, 503):
            time.sleep(rng.uniform(0.05, 0.15))  # a polite client backs off


def burst(url: str, clients: int, per_client: int) -> tuple[Tally, float]:
    """Threads, not asyncio+httpx: httpx's pool costs more per request at this concurrency
    than the tiny decodes do, and would measure the client instead of the server."""
    tally = Tally()
    threads = [
        threading.Thread(target=one_client, args=(url, tally, per_client, k))
        for k in range(clients)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tally, time.perf_counter() - t0


def server_codes(url: str) -> dict[str, float]:
    text = requests.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for code, value in re.findall(r'vae_requests_total\{code="(\d+)"[^}]*\} ([0-9.e+]+)', text):
        out[code] = out.get(code, 0) + float(value)
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("load-store")
    bake(store, "flux", "flux-tiny", TINY_FLUX["flux-tiny"])
    return store


def test_64_clients_lose_nothing_and_memory_returns(store, tmp_path):
    env = {"VAE_QUEUE_DEPTH": "32", "VAE_MAX_BATCH": "8", "VAE_LOG_FORMAT": "json"}
    with faulty.serve_process(store, tmp_path / "serve.log", **env) as (url, proc):
        warm, _ = burst(url, CLIENTS, 1)  # allocator and code paths warm
        assert not warm.lost, warm.lost
        baseline = faulty.rss_bytes(proc.pid)
        tally, wall = burst(url, CLIENTS, PER_CLIENT)
        time.sleep(1.0)
        after = faulty.rss_bytes(proc.pid)
        on_server = server_codes(url)
    total = CLIENTS * PER_CLIENT
    ok = tally.codes.get(200, 0)
    shed = sum(n for code, n in tally.codes.items() if code in (429, 503))
    p50 = statistics.median(tally.latencies)
    p99 = float(np.percentile(tally.latencies, 99))
    print(
        f"\nload: {CLIENTS} clients, {total} requests in {wall:.2f} s: {ok / wall:.1f} req/s held"
        f" ({ok} ok), p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, shed {shed}"
        f" (429/503), lost {len(tally.lost)}; RSS {baseline / 2**20:.0f} MiB before,"
        f" {after / 2**20:.0f} MiB after; codes {dict(sorted(tally.codes.items()))}"
    )
    assert not tally.lost, tally.lost  # every request answered
    assert ok + shed == total and set(tally.codes) <= {200, 429, 503}, tally.codes
    assert tally.shed_without_retry_after == 0 and tally.short_bodies == 0
    assert not [c for c in on_server if c.startswith("5") and c != "503"], on_server
    assert on_server.get("200", 0) == ok + warm.codes.get(200, 0)  # as the clients saw
    assert after < baseline * 1.25 + (64 << 20), (baseline, after)
