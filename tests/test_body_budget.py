"""Request bodies in flight share one byte budget (``VAE_BODIES_MB``): reserved before the
read (429 + Retry-After when it cannot hold a body now, 413 when it never could), released
once the body is parsed or its request ends; a declared body is read into one buffer, and a
burst's memory goes back to the OS (issue 35.6)."""

from __future__ import annotations

import asyncio
import io
import json
import re
import select
import socket
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
import requests
from starlette.requests import Request

from app.protocol import ProtocolError
from tests import faulty
from tests.helpers import faulty_family

__all__ = ["faulty_family"]  # module-scoped fixture

MIB = 1 << 20
SHAPE = (1, 4, 2560, 2560)  # float32: 100 MiB; a scale-1 model makes 2560x2560 of it
BODY = 100 * MIB
CLIENTS, ROUNDS = 16, 4
BUDGET_MB = 800  # 8 bodies of 100 MiB
RSS_MARGIN = 128 * MIB  # what a round may leave above the RSS before the first one
PEAK_LINE = re.compile(r"request bodies: (\d+) bytes at the burst's peak of a (\d+)-byte budget")


# --- a real server, 4 rounds of 16 concurrent 100 MiB bodies ---------------------------------


@pytest.fixture(scope="module")
def wide_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("body-budget-store")
    faulty.bake(store, "faulty-wide", scale=1)  # 1 latent cell = 1 pixel: big bodies, legal
    return store


def body_with_a_huge_value() -> memoryview:
    """100 MiB of zeros but a first value that ``scaling_factor=0.5`` takes past float32: the
    server reads and parses the whole body, then answers 422 without decoding it."""
    body = bytearray(BODY)
    body[:4] = struct.pack("<f", 3e38)
    return memoryview(body)


Answer = tuple[int, dict, float, str, int]


def upload(url: str, body: memoryview, seconds: float = 120) -> Answer:
    """POST ``body`` on a raw socket, reading while sending (a refused upload stops at its
    answer): (status, JSON body, seconds to the answer, the head lowercased, the body bytes
    sent before it); status 0 when none came."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    target = f"/decode/faulty-wide?shape={list(SHAPE)}&output_type=pt&scaling_factor=0.5"
    head = (
        f"POST {target.replace(' ', '')} HTTP/1.1\r\nHost: x\r\nContent-Type: tensor/binary\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=seconds) as sock:
        sock.sendall(head)
        sock.setblocking(False)
        sent, received, deadline = 0, b"", time.monotonic() + seconds
        while time.monotonic() < deadline and not _complete(received):
            writers = [sock] if sent < len(body) else []
            readable, writable, _ = select.select([sock], writers, [], 0.5)
            if writable:
                try:
                    sent += sock.send(body[sent : sent + MIB])
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    pass
            if readable:
                try:
                    chunk = sock.recv(1 << 16)
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                received += chunk
    elapsed = time.perf_counter() - t0
    if not received.startswith(b"HTTP/1.1 "):
        return 0, {}, elapsed, "", sent
    head, _, rest = received.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest or b"{}"), elapsed, head.decode().lower(), sent


def _complete(received: bytes) -> bool:
    head, sep, rest = received.partition(b"\r\n\r\n")
    if not sep:
        return False
    length = re.search(rb"content-length: (\d+)", head, re.I)
    return length is not None and len(rest) >= int(length.group(1))


class RssPeak:
    """The highest RSS of a process while the block runs (sampled every 10 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, faulty.rss_bytes(self.pid))
            time.sleep(0.01)

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def one_round(url: str, body: memoryview) -> list[Answer]:
    answers: list[Answer] = []
    threads = [threading.Thread(target=lambda: answers.append(upload(url, body)))
               for _ in range(CLIENTS)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return answers


def test_concurrent_large_bodies_stay_in_the_budget_and_memory_returns(wide_store, tmp_path):
    env = {
        "VAE_MODELS": "faulty-wide",
        "VAE_BATCH_ROWS": "1",
        "VAE_MAX_BODY_MB": "128",
        "VAE_MAX_PIXELS": str(SHAPE[-1] * SHAPE[-2]),
        "VAE_BODIES_MB": str(BUDGET_MB),
        "VAE_BODY_TIMEOUT_S": "120",
    }
    body = body_with_a_huge_value()
    log = tmp_path / "serve.log"
    rounds = []
    with faulty.serve_process(wide_store, log, faulty_family=True, **env) as (url, proc):
        small = memoryview(bytearray(MIB))  # a refused shape: warms the request path only
        upload(url, small)
        time.sleep(0.5)
        start = faulty.rss_bytes(proc.pid)
        for _ in range(ROUNDS):
            before = faulty.rss_bytes(proc.pid)
            with RssPeak(proc.pid) as peak:
                t0 = time.perf_counter()
                answers = one_round(url, body)
                wall = time.perf_counter() - t0
                time.sleep(1.0)  # the last release and its trim
            rounds.append((before, peak.peak, faulty.rss_bytes(proc.pid), wall, answers))
    text = log.read_text()
    print(f"\nRSS before the first round {start / MIB:.0f} MiB")
    for i, (before, top, after, wall, answers) in enumerate(rounds, 1):
        codes = sorted(code for code, *_ in answers)
        slowest = max(seconds for _, _, seconds, *_ in answers)
        sent = max((sent for code, *_, sent in answers if code == 429), default=0)
        print(f"round {i}: RSS {before / MIB:.0f} -> peak {top / MIB:.0f} -> {after / MIB:.0f}"
              f" MiB in {wall:.1f} s (slowest answer {slowest:.1f} s; a 429 after at most"
              f" {sent / MIB:.1f} MiB sent); codes {codes}")  # fmt: skip
    for *_, after, _wall, answers in rounds:
        codes = [code for code, *_ in answers]
        assert len(codes) == CLIENTS and set(codes) <= {422, 429}, (codes, text[-3000:])
        assert all("float32" in body["error"] for code, body, *_ in answers if code == 422)
        refused = [(sent, head) for code, _, _, head, sent in answers if code == 429]
        assert all("retry-after: 1" in head and "connection: close" in head for _, head in refused)
        # at once, not after the body: the client was still sending (its socket buffers' worth)
        assert all(sent < BODY // 2 for sent, _ in refused), [sent for sent, _ in refused]
        assert after < start + RSS_MARGIN, (start, after)
    assert 429 in {code for *_, answers in rounds for code, *_ in answers}  # the budget held
    peaks = [(int(held), int(limit)) for held, limit in PEAK_LINE.findall(text)]
    assert peaks and all(held <= limit == BUDGET_MB * MIB for held, limit in peaks), peaks


def test_a_body_declared_and_not_sent_costs_no_memory(wide_store, tmp_path):
    """Memory follows the bytes a body sends, not the length it declares: three requests that
    declare 100 MiB each and send nothing claim their room in the budget (a fourth: 429), but
    the server's resident set does not grow by their 300 MiB; and their claims lapse once they
    fall behind the pace of their body timeout (a fourth is then admitted while they still
    hold their connections: headers alone do not keep others out)."""
    env = {"VAE_MODELS": "faulty-wide", "VAE_MAX_BODY_MB": "128", "VAE_BODIES_MB": "320",
           "VAE_MAX_PIXELS": str(SHAPE[-1] * SHAPE[-2])}  # fmt: skip
    target = f"/decode/faulty-wide?shape={list(SHAPE)}&output_type=pt".replace(" ", "")
    head = (f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Type: tensor/binary\r\n"
            f"Content-Length: {BODY}\r\n\r\n").encode()  # fmt: skip
    with faulty.serve_process(wide_store, tmp_path / "serve.log", faulty_family=True, **env) as (
        url,
        proc,
    ):
        host, port = urlsplit(url).hostname, urlsplit(url).port
        upload(url, memoryview(bytearray(MIB)))  # a refused shape: warms the request path
        before = faulty.rss_bytes(proc.pid)
        held = [socket.create_connection((host, port), timeout=30) for _ in range(3)]
        for sock in held:
            sock.sendall(head)

        def refused() -> bool:  # a fourth such request: a 429 at once while the three hold
            with socket.create_connection((host, port), timeout=30) as probe:
                probe.sendall(head)
                probe.settimeout(1.0)
                try:
                    return probe.recv(64).startswith(b"HTTP/1.1 429")
                except TimeoutError:
                    return False  # admitted (then let go): the three were not all in yet

        faulty.wait_for("the three holding the budget", refused, 30)
        grown = faulty.rss_bytes(proc.pid) - before
        faulty.wait_for("their claims lapsed", lambda: not refused(), 30)
        for sock in held:  # still open, still waiting for their bodies: no answer yet
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)
            sock.close()
    assert grown < 64 * MIB, f"{grown / MIB:.0f} MiB for 300 MiB declared, none sent"


# --- the budget and the read, in process ----------------------------------------------------


def fake_request(app: SimpleNamespace, length: int | None, chunks: asyncio.Queue) -> Request:
    """A request whose body comes from ``chunks`` (None ends it) and whose app holds the
    budget and the drain, as create_app's does."""
    headers = [] if length is None else [(b"content-length", str(length).encode())]
    if length is None:
        headers.append((b"transfer-encoding", b"chunked"))

    async def receive() -> dict:
        chunk = await chunks.get()
        return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

    scope = {"type": "http", "method": "POST", "headers": headers, "app": app, "state": {}}
    return Request(scope, receive)


def service(budget: int):
    from app.http.budget import BodyBudget
    from app.http.drain import Drain

    return SimpleNamespace(state=SimpleNamespace(bodies=BodyBudget(budget), drain=Drain(8.0)))


async def read(app, length: int | None, parts: list[bytes | None], limit: int = 1 << 30):
    from app.http.body import read_body

    chunks: asyncio.Queue = asyncio.Queue()
    for part in parts:
        chunks.put_nowait(part)
    request = fake_request(app, length, chunks)
    return request, await read_body(request, limit, timeout_s=5)


def test_a_declared_body_is_read_into_one_buffer_and_holds_the_budget_until_released():
    async def main() -> None:
        app = service(1000)
        request, body = await read(app, 600, [b"a" * 100, b"b" * 500, None])
        assert isinstance(body, bytearray) and body == b"a" * 100 + b"b" * 500
        assert app.state.bodies.held == 600
        request.state.body_lease.release()  # what Envelope does once the answer is sent
        request.state.body_lease.release()  # once only
        assert app.state.bodies.held == 0

    asyncio.run(main())


def test_the_budget_refuses_429_now_and_413_outright_before_the_read():
    from app.http.budget import BodyLease

    async def main() -> None:
        app = service(1000)
        other = BodyLease(app.state.bodies)
        other.cover(700)  # another request's body in flight
        with pytest.raises(ProtocolError) as now:
            await read(app, 400, [b"x" * 400, None])
        assert now.value.status == 429 and "do not fit now" in now.value.error
        with pytest.raises(ProtocolError) as never:
            await read(app, 1001, [b"x" * 1001, None])
        assert never.value.status == 413 and "VAE_BODIES_MB" in never.value.error
        assert app.state.bodies.held == 700  # the refusals took nothing
        other.release()
        _, body = await read(app, 400, [b"x" * 400, None])
        assert len(body) == 400 and app.state.bodies.held == 400

    asyncio.run(main())


def test_a_claim_lapses_once_its_body_falls_behind_its_pace(monkeypatch):
    """A declared body claims its room before its bytes come, and keeps the claim while it
    arrives at the pace that ends it within its timeout (after a grace): one that sends
    nothing, or drips, keeps only what it sent, so it cannot keep others out; what it sends
    later is held as it arrives, within the budget."""
    from app.http import body

    monkeypatch.setattr(body, "CLAIM_GRACE_S", 0.2)

    async def pending(app, length: int) -> tuple[asyncio.Queue, asyncio.Future]:
        chunks: asyncio.Queue = asyncio.Queue()
        request = fake_request(app, length, chunks)
        reading = asyncio.ensure_future(body.read_body(request, 1 << 30, timeout_s=5))
        await asyncio.sleep(0.05)
        return chunks, reading

    async def main() -> None:
        app = service(1000)
        budget = app.state.bodies
        chunks, reading = await pending(app, 600)
        assert budget.claimed == 600 and budget.held == 0  # claimed before any byte
        with pytest.raises(ProtocolError) as now:
            await read(app, 500, [b"x" * 500, None])
        assert now.value.status == 429
        await asyncio.sleep(0.3)  # no byte within the grace: the claim lapses
        assert budget.claimed == 0 and budget.held == 0 and not reading.done()
        other, _ = await read(app, 500, [b"x" * 500, None])  # admitted now
        chunks.put_nowait(b"y" * 400)  # the lapsed body's bytes: held as they come
        await asyncio.sleep(0.05)
        assert budget.held == 900 and not reading.done()
        chunks.put_nowait(b"y" * 200)  # past the budget: 429, mid-body
        with pytest.raises(ProtocolError) as full:
            await reading
        assert full.value.status == 429
        other.state.body_lease.release()

        request, empty = await read(app, 0, [None])  # a declared empty body: nothing to claim
        assert empty == b"" and request.state.body_lease.claimed == 0
        dripping, reading = await pending(app, 600)  # a byte every 50 ms: behind its pace
        for _ in range(10):
            dripping.put_nowait(b"z")
            await asyncio.sleep(0.05)
        assert budget.claimed == 0 and not reading.done()
        reading.cancel()

    asyncio.run(main())


def test_a_parsed_input_is_held_in_the_budget_grown_or_shrunk_to_its_size():
    from app.http.body import hold
    from app.http.budget import BodyLease

    async def main() -> None:
        app = service(1000)
        request, _ = await read(app, 100, [b"x" * 100, None])
        hold(request, 400)  # a small body parsed into larger pixels
        assert app.state.bodies.held == 400
        other = BodyLease(app.state.bodies)
        other.cover(500)
        with pytest.raises(ProtocolError) as now:
            hold(request, 600)
        assert now.value.status == 429 and app.state.bodies.held == 900  # it kept its 400
        hold(request, 50)  # smaller than what it held: the rest goes back
        assert app.state.bodies.held == 550
        request.state.body_lease.release()
        assert app.state.bodies.held == 500

    asyncio.run(main())


def test_pixels_parsed_from_small_pngs_are_held_until_their_requests_end(tmp_path):
    """One anonymous client's queue of tiny PNGs that decode into large pixels: each request
    holds its pixels in the budget while it waits, so the one that would pass the budget is
    refused at once (429), not queued; once they are answered the budget takes more again."""
    from PIL import Image

    from tests.helpers import occupy, wait_queued
    from tests.live import TINY_FLUX, bake, live_server

    faulty.bake(tmp_path, "faulty")
    bake(tmp_path, "flux", "flux-enc", TINY_FLUX["flux-tiny"], encoder=True)
    buffer = io.BytesIO()
    Image.new("RGB", (1024, 1024), "gray").save(buffer, format="PNG")
    png = buffer.getvalue()  # a few KiB; 12 MiB of float32 pixels once parsed
    assert len(png) < 64 << 10

    def encode(timeout: float = 60) -> requests.Response:
        return requests.post(f"{url}/encode/flux-enc", data=png, timeout=timeout)

    settings = dict(device="cpu", dtype="float32", bodies_mb=30, batch_rows=1)
    with live_server(tmp_path, models="faulty,flux-enc", **settings) as url:
        occupy(url, tag=41)  # the worker decodes nothing else until released
        answers: list[requests.Response] = []
        queued = [threading.Thread(target=lambda: answers.append(encode())) for _ in range(2)]
        for n, thread in enumerate(queued, 1):
            thread.start()
            wait_queued(url, n)  # 12 MiB held each: 24 of 30
        refused = encode(timeout=10)  # queued instead, it would wait for the release
        faulty.release(41)
        for thread in queued:
            thread.join(60)
        again = encode()
    assert refused.status_code == 429, refused.text
    assert "what requests hold" in refused.json()["error"]
    assert refused.headers["retry-after"] == "1"
    assert [a.status_code for a in answers] == [200, 200] and again.status_code == 200


def test_an_answer_is_held_until_it_is_sent(tmp_path):
    """A decode's whole answer is reserved with its latent before it is queued and held until
    it is sent: a client that reads nothing of its 48 MiB answer keeps that room, so another
    such request is refused (429) until the first client leaves."""
    from tests.helpers import post, raw_request
    from tests.live import live_server

    faulty.bake(tmp_path, "faulty")
    z = faulty.latent(tag=43, size=256)  # a 2048x2048 float32 answer: 48 MiB, the body 1 MiB
    target = "/decode/faulty?shape=[1,4,256,256]&dtype=float32&output_type=pt"
    with live_server(tmp_path, models="faulty", device="cpu", dtype="float32", bodies_mb=64) as url:
        reader = raw_request(url, target, z.numpy().tobytes())
        reader.recv(1, socket.MSG_PEEK)  # its answer is being sent; the client reads no more
        refused = post(url, faulty.latent(tag=44, size=256))
        reader.close()
        faulty.wait_for("the answer's room free", lambda: post(url, z).status_code == 200)
    assert refused.status_code == 429 and "do not fit now" in refused.json()["error"]


@pytest.mark.parametrize("size", [256, 90], ids=["48 MiB chunked", "6 MiB whole"])
def test_an_answer_its_client_never_reads_is_dropped_after_the_stall_limit(tmp_path, size, caplog):
    """A client that stays connected and reads nothing of its answer (whole or chunked) is
    dropped once it has acknowledged nothing for ``VAE_STREAM_STALL_S``: one warning says why,
    the answer's room in the budget is free again, and the client gets a reset, not the rest
    of its answer (nothing of it stays buffered in the server for a reader that never reads)."""
    from tests.helpers import post
    from tests.live import live_server

    stall, rid = 2.0, f"never-reads-{size}"
    faulty.bake(tmp_path, "faulty")
    z = faulty.latent(tag=45, size=size)  # a float32 answer of (8 * size)^2 RGB pixels
    body = z.numpy().tobytes()
    head = (
        f"POST /decode/faulty?shape=[1,4,{size},{size}]&dtype=float32&output_type=pt HTTP/1.1"
        f"\r\nHost: x\r\nContent-Type: tensor/binary\r\nX-Request-Id: {rid}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    settings = dict(models="faulty", device="cpu", dtype="float32", stream_stall_s=stall)
    with live_server(tmp_path, bodies_mb=64, **settings) as url:
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before the connect
        reader.connect((urlsplit(url).hostname, urlsplit(url).port))
        reader.sendall(head.encode() + body)
        reader.recv(1, socket.MSG_PEEK)  # its answer is being sent; the client reads no more
        t0 = time.monotonic()
        if size == 256:  # its 48 MiB hold the budget: another one does not fit now
            assert post(url, faulty.latent(tag=46, size=size)).status_code == 429

        def warned() -> list[str]:
            lines = [r.getMessage() for r in caplog.records if rid in r.getMessage()]
            return [line for line in lines if "aborted" in line]

        faulty.wait_for("the reader dropped", warned, stall + 15)
        waited = time.monotonic() - t0
        if size == 256:
            faulty.wait_for("the answer's room free", lambda: post(url, z).status_code == 200, 30)
        got = _read_until_closed(reader)
    assert stall - 0.5 < waited < stall + 15, waited
    assert "read nothing for 2 s" in warned()[0], warned()
    answer = 3 * (8 * size) ** 2 * 4
    assert got < answer // 2, f"{got} of the answer's {answer} bytes still came"


def _read_until_closed(sock: socket.socket) -> int:
    """Bytes read until the connection ends (a reset counts as its end)."""
    sock.settimeout(10)
    got = 0
    try:
        while data := sock.recv(1 << 20):
            got += len(data)
    except ConnectionResetError:
        pass
    sock.close()
    return got


def test_a_chunked_body_takes_the_budget_as_it_grows():
    from app.http.budget import BodyLease

    async def main() -> None:
        app = service(1000)
        request, body = await read(app, None, [b"x" * 300, b"y" * 300, None])
        assert body == b"x" * 300 + b"y" * 300 and app.state.bodies.held == 600
        BodyLease(app.state.bodies).cover(300)  # 900 held now
        with pytest.raises(ProtocolError) as refused:
            await read(app, None, [b"z" * 60, b"z" * 60, None])
        assert refused.value.status == 429
        assert app.state.bodies.held == 960  # the refused one still holds its first 60 ...
        request.state.body_lease.release()  # ... until its request ends (``handled``)
        assert app.state.bodies.held == 360

    asyncio.run(main())


def test_a_budget_never_holds_more_than_its_limit_under_contention():
    from app.http.budget import BodyBudget, BodyLease

    budget, seen = BodyBudget(10_000), []

    def client(seed: int) -> None:
        for i in range(2000):
            lease = BodyLease(budget)
            try:
                lease.cover(1 + (seed * 7919 + i * 104729) % 3000)
            except ProtocolError:
                continue
            seen.append(budget.held)
            lease.release()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen and max(seen) <= 10_000 and budget.held == 0


def test_a_body_still_arriving_when_the_drain_begins_is_refused_503_at_once():
    """Issue 35.8: the read does not wait for the rest of the body (or its timeout)."""

    async def main() -> None:
        app = service(1 << 20)
        chunks: asyncio.Queue = asyncio.Queue()
        chunks.put_nowait(b"x" * 100)  # then nothing more arrives
        from app.http.body import read_body

        request = fake_request(app, 1000, chunks)
        reading = asyncio.ensure_future(read_body(request, 1 << 20, timeout_s=60))
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        app.state.drain.draining = True
        app.state.drain.began.set()
        with pytest.raises(ProtocolError) as refused:
            await reading
        assert refused.value.status == 503 and "shutting down" in refused.value.error
        assert time.perf_counter() - t0 < 0.5
        assert request.state.body_unread  # answered with Connection: close

    asyncio.run(main())
