"""vae_client reads streamed answers as they arrive (issue 36, items 8 and 9): tensors filled
in place (a ``pt`` video asked frame-major and put back as ``[B,3,T,H,W]``), the frames
received counted from the bytes (an MP4's from its fragments), a ``progress`` callback told
while the service still decodes, a bar on stderr only on a terminal, a retry that starts its
output again, and every file-taking method taking ``str`` and ``os.PathLike`` alike.

The live tests run the real service in this process (the service's tests/live.py), with the
``faulty`` family's slow video (tests/faulty.py: ``SLEEP`` per frame) so that frames can be
seen arriving before the decode ends."""

from __future__ import annotations

import asyncio
import io
import json
import os
import pty
import random
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from vae_client import AsyncClient, Client, DecodeError
from vae_client import decode as decode_once
from vae_client import encode as encode_once
from vae_client.answers import ArrayReceiver, Mp4Frames, TensorFrames, frame_counter
from vae_client.progress import ProgressBar

faulty = pytest.importorskip("tests.faulty", reason="the service's tests/faulty.py")
live = pytest.importorskip("tests.live", reason="the service's tests/live.py runs the server")

FRAMES = 6  # the slow video's frames (32x32 each)
SLOW_S = 0.3  # its decode time per frame


# --- reading an answer as it arrives (no server) ----------------------------------------------


def pieces(data: bytes, seed: int, most: int = 5000) -> Iterator[bytes]:
    """``data`` cut at random places (pieces of at most ``most`` bytes), as a network hands
    it over."""
    rng, at = random.Random(seed), 0
    while at < len(data):
        step = rng.choice([1, 3, 7, 64, most // 5, most])
        yield data[at : at + step]
        at += step


def received(data: bytes, headers: dict[str, str], seed: int = 0) -> np.ndarray:
    receiver = ArrayReceiver(httpx.Headers(headers))
    for piece in pieces(data, seed):
        receiver.write(piece)
    return receiver.result()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_frame_major_pt_video_is_put_back_in_the_decoders_layout(dtype):
    video = torch.randn(2, 3, 5, 4, 6).to(getattr(torch, dtype))  # [B,3,T,H,W]
    wire = video.transpose(1, 2).contiguous()  # what BTCHW sends: [B,T,3,H,W]
    data = (wire.view(torch.int16) if dtype == "bfloat16" else wire).numpy().tobytes()
    headers = {"shape": json.dumps(list(wire.shape)), "dtype": dtype, "x-tensor-layout": "BTCHW"}
    for seed in range(3):
        got = received(data, headers, seed)
        assert got.shape == (2, 3, 5, 4, 6) and got.flags.c_contiguous
        np.testing.assert_array_equal(got, video.float().numpy().astype(got.dtype))
    plain = {"shape": json.dumps(list(video.shape)), "dtype": dtype}  # BCTHW: as it is
    flat = (video.contiguous().view(torch.int16) if dtype == "bfloat16" else video).numpy()
    np.testing.assert_array_equal(received(flat.tobytes(), plain, 5), video.float().numpy())


def test_a_short_or_long_tensor_answer_is_an_error():
    headers = {"shape": "[2, 3, 4, 4]", "dtype": "float32"}
    data = np.zeros((2, 3, 4, 4), np.float32).tobytes()
    receiver = ArrayReceiver(httpx.Headers(headers))
    receiver.write(data[:-4])
    with pytest.raises(DecodeError, match="holds 380 bytes"):
        receiver.result()
    with pytest.raises(DecodeError, match="longer than its shape"):
        receiver.write(data)


def test_frames_are_counted_from_the_bytes_of_each_layout():
    frame = 3 * 4 * 4 * 4  # one float32 [3,4,4] frame
    major = TensorFrames(10, httpx.Headers({"shape": "[10, 3, 4, 4]", "dtype": "float32"}))
    assert [major.feed(b"\0" * n) for n in (frame - 1, 1, 2 * frame, 7 * frame)] == [0, 1, 3, 10]
    # BCTHW [2,3,5,4,4]: a row's channel-0 planes come frame by frame, then its other two
    planar = TensorFrames(
        10,
        httpx.Headers({"shape": "[2, 3, 5, 4, 4]", "dtype": "float32", "x-tensor-layout": "BCTHW"}),
    )
    plane = 4 * 4 * 4
    counts = [planar.feed(b"\0" * n) for n in (plane, 3 * plane, plane, 10 * plane, plane)]
    assert counts == [1, 4, 5, 5, 6]
    assert frame_counter("png", httpx.Headers({"x-frames": "3"})) is None
    assert frame_counter("tensor", httpx.Headers({"shape": "[1, 3, 8, 8]"})) is None  # no count


def test_an_mp4s_frames_are_counted_from_its_fragments():
    from app.media.mp4 import encode_mp4  # the service's real ffmpeg writer

    video = np.random.default_rng(0).integers(0, 255, (40, 16, 16, 3), dtype=np.uint8)
    data = b"".join(encode_mp4(video, fps=8))  # a fragment every 2 s (16 frames) or sooner
    for seed in range(3):
        counter, counts = Mp4Frames(40), []
        for piece in pieces(data, seed, most=500):  # smaller than one fragment
            counts.append(counter.feed(piece))
        assert counts == sorted(counts) and counts[-1] == 40
        assert len({n for n in counts if 0 < n < 40}) >= 2  # fragment by fragment
        assert counts[: len(counts) // 4].count(40) == 0


def test_the_bar_draws_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        bar = ProgressBar("decoding", stream=stream, interval=0)
        for done in range(5):
            bar(done, 4)
        bar.close()
    assert pipe.getvalue() == ""
    lines = tty.getvalue()
    assert lines.count("\r") == 5 and lines.endswith("\n")
    assert "[" + "#" * 24 + "] 4/4 frames" in lines and "0/4 frames" in lines


# --- against the real service -----------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def faulty_family():
    with faulty.registered():
        yield


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """flux-tiny with an encoder (for the file-taking encode methods) and the slow video."""
    from app.families.flux import decoder as flux_decoder
    from app.families.flux import encoder as flux
    from app.families.flux.encoder.model import ENCODER_CONFIG
    from app.store import write_model

    store = tmp_path_factory.mktemp("progress-store")
    small = {"block_out_channels": [16, 32, 32, 32], "layers_per_block": 1, "norm_num_groups": 8}
    encoder = flux.Encoder({**ENCODER_CONFIG, **small})
    flux.init_synthetic(encoder, torch.Generator().manual_seed(0))
    dec = flux_decoder.Decoder(live.TINY_FLUX["flux-tiny"])
    flux_decoder.init_synthetic(dec, torch.Generator().manual_seed(0))
    write_model(store, "flux-tiny", "flux", live.TINY_FLUX["flux-tiny"], dec.state_dict(),
                source="test", dtype="float32", encoder_state=encoder.state_dict(),
                encoder_config={**ENCODER_CONFIG, **small})  # fmt: skip
    faulty.bake(store, "faulty-video", video=True)
    return store


@pytest.fixture(scope="module")
def url(store) -> Iterator[str]:
    with live.live_server(store, dtype="float32", device="cpu") as url:
        yield url


def slow_video(tag: float, per_frame: float = SLOW_S) -> np.ndarray:
    return faulty.latent(faulty.SLEEP, per_frame, tag=tag, size=4, frames=FRAMES).numpy()


class Seen:
    """Every progress call, with how many frames the server had decoded by then."""

    def __init__(self, tag: float, frames: int = FRAMES) -> None:
        self.tag, self.frames, self.calls = tag, frames, []

    def __call__(self, done: int, total: int) -> None:
        self.calls.append((done, total, len(faulty.decoded(self.tag))))

    def check(self) -> None:
        done = [d for d, _, _ in self.calls]
        assert done == sorted(set(done)) and done[0] == 0 and done[-1] == self.frames, self.calls
        assert {t for _, t, _ in self.calls} == {self.frames}
        # frames arrived, and were counted, while later frames were still decoding
        early = [d for d, _, decoded in self.calls if 0 < d and decoded < self.frames]
        assert early, self.calls


@pytest.mark.parametrize("output", ["tensor", "frames", "uint8"])
def test_progress_is_told_of_frames_while_the_video_still_decodes(url, output):
    tag = 900.0 + ["tensor", "frames", "uint8"].index(output)
    seen = Seen(tag)
    params = {"partial_postprocess": True} if output == "uint8" else {}
    kind = "tensor" if output == "uint8" else output
    with Client(url, timeout=60) as c:
        got = c.decode(slow_video(tag), "faulty-video", kind, progress=seen, **params)
        quiet = c.decode(slow_video(tag + 0.5, 0), "faulty-video", kind, **params)
        np.testing.assert_array_equal(got, quiet)  # progress or not, the same answer
        shape = {"tensor": (1, 3, FRAMES, 32, 32), "frames": (FRAMES, 3, 32, 32),
                 "uint8": (FRAMES, 32, 32, 3)}[output]  # fmt: skip
        assert got.shape == shape
        if output == "tensor":
            assert c.last_call.headers["x-tensor-layout"] == "BTCHW"
    seen.check()


def test_an_mp4s_progress_moves_fragment_by_fragment(url, tmp_path):
    """A keyframe (so a fragment) every 2 s of video: at 4 fps every 8 frames; x264's own
    look-ahead holds some frames back, so the count lags the decode but moves before its end."""
    frames, tag = 40, 905.0
    seen = Seen(tag, frames)
    z = faulty.latent(faulty.SLEEP, 0.1, tag=tag, size=4, frames=frames).numpy()
    with Client(url, timeout=60) as c:
        path = c.decode_to_file(z, tmp_path / "v.mp4", "faulty-video", progress=seen, fps=4)
    assert path.stat().st_size > 0
    seen.check()


def test_async_and_to_file_report_progress_too(url, tmp_path):
    async def run(seen: Seen, tag: float) -> np.ndarray:
        async with AsyncClient(url, timeout=60) as ac:
            await ac.decode_to_file(slow_video(tag), tmp_path / "v.npy", "faulty-video",
                                    progress=seen)  # fmt: skip
            return np.load(tmp_path / "v.npy")

    seen = Seen(910.0)
    array = asyncio.run(run(seen, 910.0))
    seen.check()
    assert array.shape == (1, 3, FRAMES, 32, 32)
    seen = Seen(911.0)
    with Client(url, timeout=60) as c:
        c.decode_to_file(slow_video(911.0), str(tmp_path / "f.npy"), "faulty-video",
                         "frames", progress=seen)  # fmt: skip
    seen.check()
    assert np.load(tmp_path / "f.npy").shape == (FRAMES, 3, 32, 32)


BAR_SCRIPT = """
import sys
import numpy as np
from vae_client import Client
z = np.load(sys.argv[2])
with Client(sys.argv[1], timeout=60) as c:
    a = c.decode(z, "faulty-video", "tensor", progress=sys.argv[3] == "bar")
print(a.shape)
"""


def on_terminal(*args: str) -> tuple[str, int]:
    """Run ``args`` with stderr on a pseudo-terminal: (what it wrote there, exit status)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        out += data
    os.close(master)
    return out.decode(errors="replace"), proc.wait(60)


def test_the_built_in_bar_draws_on_a_terminal_and_not_into_a_pipe(url, tmp_path):
    np.save(tmp_path / "z.npy", slow_video(920.0, 0.05))
    run = [sys.executable, "-c", BAR_SCRIPT, url, str(tmp_path / "z.npy")]
    drawn, code = on_terminal(*run, "bar")
    assert code == 0 and f"] {FRAMES}/{FRAMES} frames" in drawn, drawn
    assert re.search("\r(?!\n)", drawn)  # redrawn in place (a terminal writes \n as \r\n)
    assert "[" + "#" * 24 + "]" in drawn
    quiet, code = on_terminal(*run, "none")  # the library's default: no bar
    assert code == 0 and quiet == "", quiet
    piped = subprocess.run([*run, "bar"], capture_output=True, text=True, timeout=60)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr  # not a terminal: nothing


# --- a retry starts the output again -----------------------------------------------------------


class Cut(ThreadingHTTPServer):
    """A front that answers the first POST with half its body (then closes), and forwards the
    rest to ``upstream`` whole."""

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _CutHandler)
        self.upstream, self.posts = upstream, 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _CutHandler(BaseHTTPRequestHandler):
    server: Cut

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        self.server.posts += 1
        keep = ("content-type", "accept", "x-request-id", "x-tensor-layout")
        headers = {k: v for k, v in self.headers.items() if k.lower() in keep}
        r = httpx.post(self.server.upstream + self.path, content=body, headers=headers, timeout=60)
        self.send_response(r.status_code)
        for k, v in r.headers.items():
            if k.lower() in ("content-type", "shape", "dtype", "x-frames", "x-tensor-layout"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(r.content)))
        self.send_header("Connection", "close")
        self.end_headers()
        cut = self.server.posts == 1
        self.wfile.write(r.content[: len(r.content) // 2] if cut else r.content)
        self.wfile.flush()


def test_a_retry_after_a_cut_answer_starts_its_output_again(url, tmp_path):
    z = slow_video(930.0, 0.0)
    with Client(url, timeout=60) as direct:
        expected = direct.decode(z, "faulty-video", "tensor")
        mp4 = direct.decode(z, "faulty-video", "mp4")
    for kind in ("tensor", "mp4"):
        front = Cut(url)
        threading.Thread(target=front.serve_forever, daemon=True).start()
        try:
            with Client(front.url, timeout=60, backoff=0.01) as c:
                if kind == "tensor":
                    got = c.decode(z, "faulty-video", "tensor")
                    np.testing.assert_array_equal(got, expected)
                else:
                    path = c.decode_to_file(z, tmp_path / "cut.mp4", "faulty-video")
                    assert path.read_bytes() == mp4  # not the cut half, then the whole
                assert c.last_call.attempts == 2 and front.posts == 2
        finally:
            front.shutdown()
            front.server_close()


# --- every file-taking method takes str and os.PathLike ------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("files")
    np.save(folder / "z.npy", np.random.default_rng(1).standard_normal((1, 16, 4, 4), np.float32))
    rgb = np.random.default_rng(2).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(folder / "photo.png")
    return folder


def _call(method: str, url: str, folder: Path, as_path) -> object:  # noqa: PLR0911
    latent, photo = as_path(folder / "z.npy"), as_path(folder / "photo.png")
    out = folder / f"out-{method}-{as_path.__name__}"
    with Client(url, timeout=60) as c:
        if method == "decode":
            return c.decode(latent, "flux-tiny")
        if method == "decode_image":
            return np.asarray(c.decode_image(latent, "flux-tiny"))
        if method == "decode_to_file":
            return c.decode_to_file(latent, as_path(f"{out}.png"), "flux-tiny").read_bytes()
        if method == "decode_to_file_npy":
            return np.load(c.decode_to_file(latent, as_path(f"{out}.npy"), "flux-tiny"))
        if method == "encode":
            return c.encode(photo, "flux-tiny")
        if method == "encode_to_file":
            return c.encode_to_file(photo, as_path(f"{out}.npy"), "flux-tiny").read_bytes()
    if method == "decode_once":
        return decode_once(latent, url=url, model="flux-tiny")
    if method == "encode_once":
        return encode_once(photo, url=url, model="flux-tiny")

    async def run() -> object:
        async with AsyncClient(url, timeout=60) as ac:
            if method == "async_decode":
                return await ac.decode(latent, "flux-tiny")
            if method == "async_decode_to_file":
                path = await ac.decode_to_file(latent, as_path(f"{out}.png"), "flux-tiny")
                return path.read_bytes()
            if method == "async_encode":
                return await ac.encode(photo, "flux-tiny")
            path = await ac.encode_to_file(photo, as_path(f"{out}.npy"), "flux-tiny")
            return path.read_bytes()

    return asyncio.run(run())


METHODS = ["decode", "decode_image", "decode_to_file", "decode_to_file_npy", "encode",
           "encode_to_file", "decode_once", "encode_once", "async_decode",
           "async_decode_to_file", "async_encode", "async_encode_to_file"]  # fmt: skip


@pytest.mark.parametrize("method", METHODS)
def test_every_file_taking_method_takes_str_and_pathlike(url, files, method):
    by_str, by_path = _call(method, url, files, str), _call(method, url, files, Path)
    if isinstance(by_path, np.ndarray):
        np.testing.assert_array_equal(by_str, by_path)
        assert by_path.size
    else:
        assert by_str == by_path and len(by_path) > 0


def test_a_str_latent_path_is_a_file_not_a_latent(url, files):
    with Client(url, timeout=60) as c, pytest.raises(ValueError, match="is .npy or .safetensors"):
        c.decode(str(files / "photo.png"), "flux-tiny")
    with Client(url, timeout=60) as c, pytest.raises(FileNotFoundError):
        c.decode(str(files / "absent.npy"), "flux-tiny")
