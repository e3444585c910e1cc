"""A bounded load test on loopback: 64 concurrent clients against a real `python -m app serve`.

Asserts: zero 5xx, zero lost (every request gets an answer, every 200 a whole body), shed
requests answered 429/503 with Retry-After, and the server's memory back near its baseline.
Prints the numbers (``pytest -s``): requests/s held, p50/p99 latency, shed count.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import subprocess
import sys
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
            r = session.post(f"{url}/decode/flux-tiny", data=LATENT, params=params)
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
    return {code: n for code, n in out.items() if n}  # label sets exist at 0 from the start


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


# --- a storm of good and hostile requests together (issue 15) -----------------------------

HOSTILE_NPY = (
    b"\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (-1, -256), }"
    + b" " * 52
    + b"\n"
    + b"\0" * 1024
)


def raw_status(url: str, request: bytes, trickle: bool = False) -> int:
    """Status of the answer to ``request`` on a raw socket (headers only, no body), or 0.
    ``trickle``: after the request line, one header byte every 0.2 s until answered."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=0.2 if trickle else 30) as s:
        s.sendall(request)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                head = s.recv(64)
                return int(head.split()[1]) if head else 0
            except TimeoutError:
                s.sendall(b"X")
    return 0


def storm_requests(url: str) -> dict[str, tuple[set[int], object]]:
    """name -> (the codes it may get, a call returning its status)."""
    z = f"{url}/decode/flux-tiny"

    def post(*args, **kwargs) -> requests.Response:
        return requests.post(*args, timeout=60, **kwargs)  # none may hang

    pt = {"shape": "[1,16,4,4]", "output_type": "pt"}
    big = 256 << 20

    def oversize_unread() -> int:  # 256 MB declared, a shape the pixel limit refuses, no body
        return raw_status(
            url,
            f"POST /decode/flux-tiny?shape=[1,16,512,512] HTTP/1.1\r\nHost: x\r\n"
            f"Content-Length: {big}\r\n\r\n".encode(),
        )

    calls = {
        "good_pt": ({200, 429, 503}, lambda: post(z, data=LATENT, params=pt)),
        "good_png": (
            {200, 429, 503},
            lambda: post(z, data=LATENT, params={"shape": "[1,16,4,4]"}),
        ),
        "oversize_unread": ({413}, oversize_unread),
        "output_cap": (
            {413},
            lambda: post(
                z, data=b"\0" * (16 * 48 * 48 * 4), params={**pt, "shape": "[1,16,48,48]"}
            ),
        ),
        "not_finite": (
            {422, 429, 503},
            lambda: post(z, data=LATENT, params={**pt, "shift_factor": "1e20"}),
        ),
        "npy_negative": (
            {400},
            lambda: post(z, data=HOSTILE_NPY, headers={"Content-Type": "application/x-npy"}),
        ),
        "log_injection": ({404}, lambda: post(f"{z}%0d%0aERROR%00forged", data=LATENT, params=pt)),
        "gzip": (
            {415},
            lambda: post(z, data=LATENT, params=pt, headers={"Content-Encoding": "gzip"}),
        ),
        "bad_height": ({422}, lambda: post(z, data=LATENT, params={**pt, "height": "99999"})),
        "long_param": ({422}, lambda: post(z, data=LATENT, params={"shape": "9" * 14000})),
        "head_probe": ({200}, lambda: requests.head(f"{url}/healthz", timeout=10)),
        "slow_headers": (
            {408},
            lambda: raw_status(url, b"GET /healthz HTTP/1.1\r\nHost: x\r\n", trickle=True),
        ),
    }
    return calls


LOOP_CPU_S = 0.05  # the most CPU one event-loop callback may take in the storm (5 ms seen)


def test_a_storm_of_good_and_hostile_requests_loses_nothing(store, tmp_path):
    """32 clients, 8 calls each, good and hostile mixed: every call answered with what its
    kind expects (no 5xx but 503 + Retry-After, none lost or hung), /healthz stays quick,
    and the server's memory comes back near its baseline."""
    env = {"VAE_MAX_OUTPUT_MB": "1", "VAE_HEADER_TIMEOUT_S": "2", "VAE_LOG_FORMAT": "json"}
    clients, per_client = 32, 8
    got: dict[str, list] = {}
    lock = threading.Lock()

    def client(k: int, calls: dict) -> None:
        names = sorted(calls)
        for i in range(per_client):
            name = names[(k * per_client + i) % len(names)]
            try:
                r = calls[name][1]()
                code = r if isinstance(r, int) else r.status_code
                if code in (429, 503) and not isinstance(r, int):
                    code = code if "Retry-After" in r.headers else f"{code} without Retry-After"
            except requests.RequestException as exc:
                code = type(exc).__name__
            with lock:
                got.setdefault(name, []).append(code)

    loop_log = tmp_path / "loop_cpu.jsonl"  # the loop's long callbacks (tests/loop_cpu.py)
    env["LOOP_CPU_COLLECT_S"] = "0.5"  # a full garbage collection on the loop twice a second
    serving = faulty.serve_process(store, tmp_path / "serve.log", loop_cpu_log=loop_log, **env)
    with serving as (url, proc):
        calls = storm_requests(url)
        burst(url, 16, 1)  # warm
        baseline = faulty.rss_bytes(proc.pid)
        threads = [threading.Thread(target=client, args=(k, calls)) for k in range(clients)]
        prober = subprocess.Popen(
            [sys.executable, "-m", "tests.healthz_probe", url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        t0, started = time.perf_counter(), time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        wall = time.perf_counter() - t0
        probed, _ = prober.communicate("", timeout=60)  # a probe of more than 30 s fails it
        probes = [float(seconds) for seconds in probed.split()]
        time.sleep(1.0)
        after = faulty.rss_bytes(proc.pid)
        on_server = server_codes(url)
    logged = loop_log.read_text().splitlines() if loop_log.exists() else []
    on_loop = [c for c in map(json.loads, logged) if c["at"] >= started]
    longest = max(on_loop, key=lambda c: c["cpu_s"], default=None)
    summary = {name: dict(sorted({str(c): codes.count(c) for c in codes}.items()))
               for name, codes in sorted(got.items())}  # fmt: skip
    print(
        f"\nstorm: {clients * per_client} calls in {wall:.1f} s; healthz max "
        f"{max(probes) * 1000:.0f} ms over {len(probes)} probes; RSS {baseline / 2**20:.0f} MiB"
        f" before, {after / 2**20:.0f} MiB after; the loop's longest callback {longest}; {summary}"
    )
    assert sum(len(c) for c in got.values()) == clients * per_client
    for name, codes in got.items():
        assert set(codes) <= calls[name][0], (name, codes)
    assert not [c for c in on_server if c.startswith("5") and c != "503"], on_server
    # the loop is quick as a rule: a kind of call that blocked it (a parse on it stalled
    # /healthz 10 s: test_http holds that one) would slow the probes all through the storm.
    # The slowest is the first, queued behind the 32 clients' first calls: 35-80 ms on a
    # quiet 2-core machine (0.2-0.8 s before the freeze below), and 5.3 s was seen on a CI
    # machine that ran the suite 3.7x slower than usual.
    median = sorted(probes)[len(probes) // 2]
    assert prober.returncode == 0 and median < 0.5 and max(probes) < 15.0, (probes, median)
    # and in CPU time, which a loaded machine does not stretch: no callback of the loop's
    # holds it long, a full garbage collection's included (one took 130 ms of it on a 2-core
    # Xeon before the service froze what its imports made: README, "The collector")
    assert not [c for c in on_loop if c["cpu_s"] > LOOP_CPU_S], on_loop
    assert after < baseline * 1.25 + (64 << 20), (baseline, after)
