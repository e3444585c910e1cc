"""vae_client against the real service on loopback (the service's tests/live.py).

Overload, stalls and refusals come from the real service (a queue of depth 1) or from a
real HTTP front (``Gate``) that answers 429 / stalls and otherwise forwards to the service.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.numpy import save as save_safetensors

from vae_client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    DecodeError,
    decode,
    parse_retry_after,
    parse_server_timing,
)

H = W = 4  # latent cells: 32x32-pixel images keep each decode cheap on a shared CPU


def latent(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.fixture(scope="module")
def client(flux_server) -> Iterator[Client]:
    with Client(flux_server, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def z() -> np.ndarray:
    return latent(1, 16, H, W)


@pytest.fixture(scope="module")
def png(client, z) -> bytes:
    return client.decode(z, "flux-tiny", "png")


# --- each output type ----------------------------------------------------------------


def test_png_is_the_frames_tensor_rounded(client, z, png):
    frames = client.decode(z, "flux-tiny", "frames")
    assert frames.shape == (1, 3, 8 * H, 8 * W) and frames.dtype == np.float32
    assert 0 <= frames.min() and frames.max() <= 1
    expected = np.round(frames[0].transpose(1, 2, 0) * 255).astype(np.uint8)
    np.testing.assert_array_equal(pixels(png), expected)


@pytest.mark.parametrize(("output", "pil_format"), [("jpeg", "JPEG"), ("webp", "WEBP")])
def test_lossy_images(client, z, png, output, pil_format):
    data = client.decode(z, "flux-tiny", output, quality=95)
    image = Image.open(io.BytesIO(data))
    assert image.format == pil_format and image.size == (8 * W, 8 * H)
    buf = io.BytesIO()  # the same pixels through Pillow at the same quality: the same bytes
    Image.fromarray(pixels(png)).save(buf, format=pil_format, quality=95)
    assert data == buf.getvalue()


def test_tensor_outputs(client, z, png):
    raw = client.decode(z, "flux-tiny", "tensor")
    assert raw.shape == (1, 3, 8 * H, 8 * W) and raw.dtype == np.float32
    assert raw.min() < 0  # the decoder's own [-1, 1] space, not post-processed
    u8 = client.decode(z, "flux-tiny", "tensor", partial_postprocess=True)
    assert u8.dtype == np.uint8 and u8.shape == (1, 8 * H, 8 * W, 3)
    np.testing.assert_array_equal(u8[0], pixels(png))
    half = client.decode(z.astype(np.float16), "flux-tiny", "tensor")
    assert half.dtype == np.float16  # answered in the request's dtype
    np.testing.assert_allclose(half, raw, atol=2e-2)


def test_every_latent_input_is_the_same_request(client, z, png, tmp_path):
    np.save(tmp_path / "z.npy", z)
    (tmp_path / "z.safetensors").write_bytes(save_safetensors({"latent": z}))
    inputs = [
        (z.tobytes(), {"shape": list(z.shape), "dtype": "float32"}),
        (tmp_path / "z.npy", {}),
        (tmp_path / "z.safetensors", {}),
        (torch.from_numpy(z), {}),
    ]
    for source, params in inputs:
        assert client.decode(source, "flux-tiny", **params) == png, type(source)
    bf16 = client.decode(torch.from_numpy(z).bfloat16(), "flux-tiny", "tensor")
    assert bf16.dtype == np.float32 and bf16.shape == (1, 3, 8 * H, 8 * W)


def test_default_model_route_and_one_shot_helper(flux_server, z, png):
    assert decode(z, url=flux_server) == png  # POST /decode: the server's default model


def test_server_timing_and_request_id(client, z):
    client.decode(z, "flux-tiny")
    phases, call = client.last_timings, client.last_call
    assert {"parse", "queue", "conv_in", "encode", "total"} <= set(phases)
    assert all(ms >= 0 for ms in phases.values())
    assert (
        call.attempts == 1 and call.status == 200 and re.fullmatch(r"[0-9a-f]{32}", call.request_id)
    )  # noqa: E501
    seen: dict[str, float] = {}
    worker = threading.Thread(target=lambda: seen.update(client.last_timings))
    worker.start()
    worker.join()
    assert seen == {}  # another thread has made no call: it sees none of this one's


def test_async_client(flux_server, z, png):
    async def run() -> list[bytes]:
        async with AsyncClient(flux_server, timeout=60) as ac:
            out = await asyncio.gather(ac.decode(z, "flux-tiny"), ac.decode(z, "flux-tiny"))
            assert ac.last_timings == {} or "total" in ac.last_timings
            return out

    assert asyncio.run(run()) == [png, png]


# --- refusals ------------------------------------------------------------------------


def test_4xx_is_raised_with_the_servers_words(client):
    with pytest.raises(DecodeError) as info:
        client.decode(latent(1, 4, H, W), "flux-tiny")
    err = info.value
    assert err.status == 422 and "4 channels" in err.error and err.expected == "[B,16,H,W]"
    assert "4 channels" in str(err) and "[B,16,H,W]" in str(err)
    with pytest.raises(DecodeError, match="not found") as info:
        client.decode(latent(1, 16, H, W), "no-such-model")
    assert info.value.status == 404 and "flux-tiny" in info.value.expected


def test_bad_arguments_fail_before_any_request(client):
    with pytest.raises(ValueError, match="output"):
        client.decode(latent(1, 16, H, W), "flux-tiny", "gif")
    with pytest.raises(ValueError, match="shape"):
        client.decode(b"\0" * 64, "flux-tiny")
    with pytest.raises(ValueError, match="dtype"):
        client.decode(np.zeros((1, 16, H, W), np.int32), "flux-tiny")


def test_unreachable_service():
    with (
        socket_port() as port,
        Client(f"http://127.0.0.1:{port}", max_retries=1, backoff=0.01) as c,
    ):  # noqa: E501
        with pytest.raises(DecodeError, match="cannot reach") as info:
            c.decode(latent(1, 16, H, W))
    assert info.value.status is None


@contextmanager
def socket_port() -> Iterator[int]:
    import socket

    with socket.socket() as s:  # bound, not listening: connections are refused
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


# --- overload, Retry-After and the deadline ---------------------------------------------


class Gate(ThreadingHTTPServer):
    """A real HTTP front: the first ``refuse`` POSTs get 429 + Retry-After, or every POST
    stalls ``stall`` seconds; the rest are forwarded to ``upstream``."""

    daemon_threads = True

    def __init__(self, upstream: str, refuse: int = 0, retry_after: str = "1", stall: float = 0):
        super().__init__(("127.0.0.1", 0), _GateHandler)
        self.upstream, self.refuse, self.retry_after, self.stall = (
            upstream,
            refuse,
            retry_after,
            stall,
        )  # noqa: E501
        self.arrivals: list[float] = []
        self.lock, self.wake = threading.Lock(), threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _GateHandler(BaseHTTPRequestHandler):
    server: Gate

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        with self.server.lock:
            self.server.arrivals.append(time.monotonic())
            n = len(self.server.arrivals)
        if n <= self.server.refuse:
            busy = json.dumps({"error": "busy", "expected": "retry"}).encode()
            return self._reply(429, {"Retry-After": self.server.retry_after}, busy)
        if self.server.stall:
            self.server.wake.wait(self.server.stall)
        keep = ("content-type", "accept", "x-request-id")
        headers = {k: v for k, v in self.headers.items() if k.lower() in keep}
        r = httpx.post(self.server.upstream + self.path, content=body, headers=headers, timeout=60)
        relay = ("content-type", "shape", "dtype", "server-timing", "x-request-id")
        self._reply(r.status_code, {k: v for k, v in r.headers.items() if k in relay}, r.content)

    def _reply(self, status: int, headers: dict[str, str], body: bytes) -> None:
        try:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (the deadline tests)


@contextmanager
def gate(upstream: str, **options) -> Iterator[Gate]:
    server = Gate(upstream, **options)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.wake.set()
        server.shutdown()
        server.server_close()


def test_retry_after_is_honoured(flux_server, z, png):
    options = {"jitter": 0.2, "backoff": 0.25}
    with gate(flux_server, refuse=2, retry_after="1") as front, Client(front.url, **options) as c:
        assert c.decode(z, "flux-tiny") == png
        call = c.last_call
    assert call.attempts == 3
    # each wait is Retry-After x (1 + jitter*U) + backoff*U; the server saw them all elapse
    longest = 1.0 * (1 + options["jitter"]) + options["backoff"]
    assert len(call.waits) == 2 and all(1.0 <= w <= longest for w in call.waits)
    gaps = np.diff(front.arrivals)
    assert len(gaps) == 2 and (gaps >= np.array(call.waits)).all()


def test_retries_are_bounded(flux_server, z):
    with gate(flux_server, refuse=99, retry_after="0") as front:
        with (
            Client(front.url, max_retries=2, backoff=0.01) as c,
            pytest.raises(DecodeError) as info,
        ):  # noqa: E501
            c.decode(z, "flux-tiny")
    assert info.value.status == 429 and info.value.error == "busy"
    assert len(front.arrivals) == 3


# "At once" below is well under the 30 s stall / Retry-After the client must not sit out; the
# bound leaves a slow, loaded machine room.
AT_ONCE_S = 10.0


def test_deadline_while_the_server_stalls(flux_server, z):
    with gate(flux_server, stall=30) as front, Client(front.url, deadline=0.6) as c:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.decode(z, "flux-tiny")
        assert time.monotonic() - t0 < AT_ONCE_S
        assert isinstance(DeadlineExceeded(None, ""), TimeoutError)


def test_deadline_shorter_than_retry_after_fails_at_once(flux_server, z):
    with gate(flux_server, refuse=99, retry_after="30") as front, Client(front.url) as c:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            c.decode(z, "flux-tiny", deadline=5)
        assert time.monotonic() - t0 < AT_ONCE_S and info.value.status == 429
        assert len(front.arrivals) == 1  # it did not sleep into the deadline


def test_a_429_storm_from_the_real_queue_is_ridden_out(flux_store, live_server):
    """Queue depth 1, no batching: concurrent callers overflow the queue and get 429 with
    Retry-After from the service itself; every one of them still gets its image."""
    n = 5
    with live_server(flux_store, models="flux-tiny", dtype="float32", queue_depth=1, batch_rows=1,
                     retry_after_s=1) as url:  # fmt: skip
        results: list[bytes | None] = [None] * n
        attempts = [0] * n
        barrier = threading.Barrier(n)

        def call(i: int) -> None:
            with Client(url, max_retries=30, deadline=60, timeout=60) as c:
                barrier.wait()
                results[i] = c.decode(latent(1, 16, 16, 16, seed=i), "flux-tiny")
                attempts[i] = c.last_call.attempts

        threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        metrics = httpx.get(f"{url}/metrics").text
    assert all(r is not None and r.startswith(b"\x89PNG") for r in results)
    refused = re.findall(r'vae_requests_total\{[^}]*code="429"[^}]*\} (\S+)', metrics)
    total_429 = sum(float(v) for v in refused)
    assert total_429 >= 1 and sum(attempts) == n + total_429


# --- video ---------------------------------------------------------------------------


def test_video_frames_and_mp4(video_server, tmp_path):
    zv = latent(1, 24, 2, 2, 2)  # 2 latent frames of 32x32 pixels
    with Client(video_server, timeout=60) as c:
        frames = c.decode(zv, "video-tiny", "frames")
        assert frames.ndim == 4 and frames.shape[1:] == (3, 32, 32)
        head = c.last_call.headers  # streamed as it decoded, the frame count in its head
        assert head["x-frames"] == str(frames.shape[0]) and "content-length" not in head
        path = c.decode_to_file(zv, tmp_path / "v.mp4", "video-tiny", fps=12)
    import imageio_ffmpeg

    n, seconds = imageio_ffmpeg.count_frames_and_secs(str(path))
    assert n == frames.shape[0] and seconds == pytest.approx(n / 12, abs=0.1)


def test_helpers():
    assert parse_server_timing('parse;dur=1.5, up_0;desc="x";dur=3, total;dur=9') == {
        "parse": 1.5, "up_0": 3.0, "total": 9.0,
    }  # fmt: skip
    assert parse_server_timing(None) == {} and parse_server_timing("a, b;dur=x") == {}
    assert parse_retry_after("2") == 2 and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0


def test_tensor_results_are_writable(client, z):
    array = client.decode(z, "flux-tiny", "tensor")
    array += 1  # a numpy array the caller owns, not a view of immutable bytes


def test_retry_after_beyond_max_backoff_is_not_slept_on(flux_server, z):
    with gate(flux_server, refuse=99, retry_after="120") as front, Client(front.url) as c:
        t0 = time.monotonic()
        with pytest.raises(DecodeError) as info:
            c.decode(z, "flux-tiny")
        assert time.monotonic() - t0 < AT_ONCE_S and info.value.status == 429
        assert not isinstance(info.value, DeadlineExceeded)


class _Page(BaseHTTPRequestHandler):
    """Not the service: a 200 HTML page for every POST (a proxy's, a static file server's)."""

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        page = b"<html><body>hello</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)


def test_a_200_that_is_not_what_was_asked_for_is_an_error(z, tmp_path):
    """Written as the image before: ``decode`` returned the page, ``decode_to_file`` wrote it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with Client(url, max_retries=0) as c:
            with pytest.raises(DecodeError, match="the answer is text/html, not image/png"):
                c.decode(z, "flux-tiny")
            with pytest.raises(DecodeError, match="not video/mp4: is http"):
                c.decode_to_file(z, tmp_path / "out.mp4", model="wan-tiny")
            with pytest.raises(DecodeError, match="not application/x-npy"):
                c.encode_to_file(np.zeros((1, 3, 8, 8), np.float32), tmp_path / "z.npy", model="m")
        assert not list(tmp_path.iterdir())

        async def both() -> None:
            async with AsyncClient(url, max_retries=0) as c:
                with pytest.raises(DecodeError, match="not image/png"):
                    await c.decode(z, "flux-tiny")

        asyncio.run(both())
    finally:
        server.shutdown()
        server.server_close()
