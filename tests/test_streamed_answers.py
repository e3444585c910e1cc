"""Every video answer streams (issue 36, items 8 and 2): ``pt`` (the decoder's own
``[B,3,T,H,W]``, or ``[B,T,3,H,W]`` on ``X-Tensor-Layout: BTCHW``), ``partial_postprocess``
uint8 frames, the ``[N,3,H,W]`` unit frames and MP4 are sent chunked (no Content-Length) as
the frames decode, with the frame count and shape in the head; their bytes are those of the
whole decode (the runner's one-pass ``decode`` in this process). A finished tensor answer
over ``CHUNKED_OVER`` goes chunked too. diffusers' own ``remote_decode`` reads them unchanged.

Real uvicorn on loopback; a tiny Wan 2.1 (``wan2.1-tiny``'s config, seeded) served float32
(the exact path, as the local decode), and the ``faulty`` family for slow and failing decodes.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from urllib.parse import urlencode, urlsplit

import numpy as np
import pytest
import requests
import torch

from app.cli.local_decode import load_runtime
from app.http.responses import CHUNKED_OVER
from app.media import write
from app.media.mp4 import encode_mp4
from app.protocol import parse_head, validate
from app.telemetry.timing import PhaseTimer
from tests import faulty
from tests.live import bake, live_server

MODEL = "wan-tiny"
LATENT = (1, 16, 3, 4, 6)  # 3 latent frames -> 9 frames of 32x48
FRAMES, H, W = 9, 32, 48
pytestmark = [
    pytest.mark.filterwarnings("ignore:`do_scaling` is deprecated:FutureWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def faulty_family():
    with faulty.registered():
        yield


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from app.families.wan import decoder as wan

    store = tmp_path_factory.mktemp("streamed-store")
    bake(store, "wan", MODEL, wan.SYNTHETIC["wan2.1-tiny"])
    faulty.bake(store, "faulty")
    faulty.bake(store, "faulty-video", video=True)
    return store


@pytest.fixture(scope="module")
def url(store):
    with live_server(store, dtype="float32", device="cpu") as url:
        yield url


@pytest.fixture(scope="module")
def local(store):
    """The same model decoded in this process, on the runner's whole-decode path: what a
    video answer was before it streamed."""
    runtime, served = load_runtime(store, MODEL, PhaseTimer())
    return runtime, served


def latent(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def wire(z: torch.Tensor) -> bytes:
    return write.tensor_bytes(z)[0]


def query(z: torch.Tensor, **params: str) -> dict[str, str]:
    return {"shape": json.dumps(list(z.shape)), "dtype": write.WIRE_NAME[z.dtype], **params}


def whole_decode(local, z: torch.Tensor, params: dict[str, str], accept: str | None):
    """The decoded tensor as the runner's one-pass decode gives it (today's answer)."""
    runtime, served = local
    headers = [("content-type", "tensor/binary")] + ([("accept", accept)] if accept else [])
    head = parse_head(list(query(z, **params).items()), headers)
    limits = served.limits(runtime.settings.limits())
    body = wire(z)
    request = asyncio.run(validate(head, served.geometry, limits, lambda limit: body))
    return runtime.runner.decode(served, request, PhaseTimer()), request


def raw_post(url: str, path: str, z: torch.Tensor, params: dict, headers: dict):
    """POST on http.client: the head as the server sent it, then the body."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    target = f"{path}?{urlencode(query(z, **params))}"
    conn.request("POST", target, wire(z), {"Content-Type": "tensor/binary", **headers})
    response = conn.getresponse()
    head = {k.lower(): v for k, v in response.getheaders()}
    body = response.read()
    conn.close()
    return response.status, head, body


# output -> (query params, request headers, expected body shape, what the body holds)
CASES = {
    "pt": ({"output_type": "pt"}, {}, [1, 3, FRAMES, H, W], "decoder"),
    "pt-btchw": ({"output_type": "pt"}, {"X-Tensor-Layout": "BTCHW"}, [1, FRAMES, 3, H, W], "t"),
    "uint8": (
        {"output_type": "pt", "partial_postprocess": "true"},
        {},
        [FRAMES, H, W, 3],
        "decoder",
    ),
    "unit": ({"output_type": "pil"}, {"Accept": "tensor/binary"}, [FRAMES, 3, H, W], "decoder"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_video_tensor_answer_streams_chunked_with_its_head_and_the_same_bytes(
    url, local, case
):
    params, headers, shape, holds = CASES[case]
    z = latent(*LATENT, seed=1)
    status, head, body = raw_post(url, f"/decode/{MODEL}", z, params, headers)
    assert status == 200, body[:300]
    assert head.get("transfer-encoding") == "chunked" and "content-length" not in head
    assert head["x-frames"] == str(FRAMES) and json.loads(head["shape"]) == shape
    decoded, request = whole_decode(local, z, params, headers.get("Accept"))
    assert head["dtype"] == write.WIRE_NAME[request.out_dtype]
    if case.startswith("pt"):
        assert head["x-tensor-layout"] == ("BTCHW" if holds == "t" else "BCTHW")
    expected = decoded.transpose(1, 2) if holds == "t" else decoded
    assert list(expected.shape) == shape
    assert body == wire(expected)


def test_a_bfloat16_and_a_batch_of_two_stream_row_by_row_as_the_whole_decode(url, local):
    for z in (latent(*LATENT, seed=2, dtype=torch.bfloat16), latent(2, *LATENT[1:], seed=3)):
        status, head, body = raw_post(url, f"/decode/{MODEL}", z, {"output_type": "pt"}, {})
        assert status == 200 and head.get("transfer-encoding") == "chunked"
        b = z.shape[0]
        assert head["x-frames"] == str(b * FRAMES) and head["dtype"] == write.WIRE_NAME[z.dtype]
        assert json.loads(head["shape"]) == [b, 3, FRAMES, H, W]
        decoded, _ = whole_decode(local, z, {"output_type": "pt"}, None)
        assert body == wire(decoded)
        # the same rows, frame-major: every frame's bytes in (row, frame) order
        status, head, frames = raw_post(
            url, f"/decode/{MODEL}", z, {"output_type": "pt"}, {"X-Tensor-Layout": "btchw"}
        )
        assert status == 200 and head["x-tensor-layout"] == "BTCHW"
        assert frames == wire(decoded.transpose(1, 2))


def test_an_mp4_streams_with_its_frame_count_and_the_same_bytes(url, local):
    z = latent(*LATENT, seed=4)
    status, head, body = raw_post(url, f"/decode/{MODEL}", z, {"output_type": "mp4"}, {})
    assert status == 200 and head.get("transfer-encoding") == "chunked"
    assert "content-length" not in head and head["x-frames"] == str(FRAMES)
    frames, request = whole_decode(local, z, {"output_type": "mp4"}, None)
    runtime, _ = local
    threads = runtime.settings.encoder_threads
    assert body == b"".join(encode_mp4(frames.numpy(), request.fps, threads=threads))


def test_remote_decode_reads_the_streamed_answers_unchanged(url, local):
    from diffusers.utils.remote_utils import remote_decode
    from diffusers.video_processor import VideoProcessor

    z = latent(*LATENT, seed=5)
    endpoint = f"{url}/decode/{MODEL}"
    common = {"do_scaling": False}
    got = remote_decode(endpoint, z, output_type="pt", return_type="pt", **common)
    decoded, _ = whole_decode(local, z, {"output_type": "pt"}, None)
    assert got.shape == (1, 3, FRAMES, H, W) and torch.equal(got, decoded)
    u8 = remote_decode(endpoint, z, output_type="pt", return_type="pt",
                       partial_postprocess=True, **common)  # fmt: skip
    frames, _ = whole_decode(local, z, {"output_type": "pt", "partial_postprocess": "true"}, None)
    assert u8.dtype == torch.uint8 and torch.equal(u8, frames)
    processor = VideoProcessor(vae_scale_factor=8)
    unit = remote_decode(endpoint, z, processor=processor, output_type="pil",
                         return_type="pt", **common)  # fmt: skip
    expected, _ = whole_decode(local, z, {"output_type": "pil"}, "tensor/binary")
    assert torch.equal(unit, expected)
    mp4 = remote_decode(endpoint, z, output_type="mp4", return_type="mp4", **common)
    _, _, body = raw_post(url, f"/decode/{MODEL}", z, {"output_type": "mp4"}, {})
    assert isinstance(mp4, bytes) and mp4 == body


def test_a_large_image_tensor_answer_goes_chunked_a_small_one_keeps_its_length(url):
    z = latent(4, 4, 64, 64, seed=6)  # faulty: 4 x 512x512 RGB float32 = 12 MiB
    status, head, body = raw_post(url, "/decode/faulty", z, {"output_type": "pt"}, {})
    assert status == 200 and len(body) > CHUNKED_OVER
    assert head.get("transfer-encoding") == "chunked" and "content-length" not in head
    assert json.loads(head["shape"]) == [4, 3, 512, 512] and "x-frames" not in head
    got = np.frombuffer(body, "<f4").reshape(4, 3, 512, 512)
    for row in (0, 3):  # each row is what that row alone decodes to (a small answer)
        one = z[row : row + 1]
        status, small, data = raw_post(url, "/decode/faulty", one, {"output_type": "pt"}, {})
        assert status == 200 and small["content-length"] == str(len(data))
        alone = np.frombuffer(data, "<f4").reshape(1, 3, 512, 512)
        np.testing.assert_array_equal(got[row : row + 1], alone)


def test_frames_arrive_while_the_video_still_decodes(url):
    """The head leaves with the first frame, and each frame as it is decoded: the first body
    bytes arrive while most frames are still to decode."""
    frames, per_frame = 8, 0.25
    z = faulty.latent(faulty.SLEEP, per_frame, tag=801.0, size=4, frames=frames)
    t0 = time.monotonic()
    r = requests.post(f"{url}/decode/faulty-video", params=query(z, output_type="pt"),
                      data=wire(z), headers={"Content-Type": "tensor/binary"}, stream=True,
                      timeout=60)  # fmt: skip
    head_at, decoded_at_head = time.monotonic() - t0, len(faulty.decoded(801.0))
    assert r.status_code == 200 and r.headers["x-frames"] == str(frames)
    arrivals = []  # (seconds, bytes so far, frames decoded by then)
    got = 0
    for chunk in r.iter_content(chunk_size=None):
        got += len(chunk)
        arrivals.append((time.monotonic() - t0, got, len(faulty.decoded(801.0))))
    total = time.monotonic() - t0
    assert got == frames * 3 * 32 * 32 * 4
    assert decoded_at_head < frames  # the head did not wait for the whole video
    assert arrivals[0][2] < frames and arrivals[0][0] < total - 2 * per_frame
    print(f"\nfaulty-video {frames} frames x {per_frame} s: head {head_at:.2f} s, first body "
          f"bytes {arrivals[0][0]:.2f} s, whole body {total:.2f} s")  # fmt: skip


def test_a_decode_that_fails_midway_truncates_the_stream_and_one_before_answers_json(url):
    before = faulty.latent(faulty.CRASH, 0, tag=802.0, size=4, frames=4)
    r = requests.post(f"{url}/decode/faulty-video", params=query(before, output_type="pt"),
                      data=wire(before), headers={"Content-Type": "tensor/binary"},
                      timeout=60)  # fmt: skip
    assert r.status_code == 503 and "injected decoder fault" in r.json()["error"]
    midway = faulty.latent(faulty.CRASH, 2, tag=803.0, size=4, frames=4)
    r = requests.post(f"{url}/decode/faulty-video", params=query(midway, output_type="pt"),
                      data=wire(midway), headers={"Content-Type": "tensor/binary"},
                      stream=True, timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.headers["x-frames"] == "4"
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        r.content  # noqa: B018 - no terminating chunk: the client sees the truncation


def test_a_client_that_leaves_midway_stops_the_decode(url):
    frames = 40
    z = faulty.latent(faulty.SLEEP, 0.1, tag=804.0, size=4, frames=frames)
    r = requests.post(f"{url}/decode/faulty-video", params=query(z, output_type="pt"),
                      data=wire(z), headers={"Content-Type": "tensor/binary"}, stream=True,
                      timeout=60)  # fmt: skip
    next(r.iter_content(chunk_size=1024))
    r.close()  # gone after the first frame
    faulty.wait_for("the decode stops", lambda: _stable(804.0), timeout=30)
    assert len(faulty.decoded(804.0)) < frames


def test_an_mp4_whose_client_leaves_stops_and_reaps_its_ffmpeg(url):
    """The MP4 body shares the streams' ending with the tensor ones: gone midway, the decode
    stops and its ffmpeg is killed and reaped."""
    from tests.mp4_client import ffmpeg_children

    frames = 60
    z = faulty.latent(faulty.SLEEP, 0.1, tag=805.0, size=4, frames=frames)
    r = requests.post(f"{url}/decode/faulty-video", params=query(z, output_type="mp4", fps="4"),
                      data=wire(z), headers={"Content-Type": "tensor/binary"}, stream=True,
                      timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.headers["x-frames"] == str(frames)
    body = r.iter_content(chunk_size=16)  # held: a dropped one closes the connection at once
    next(body)  # ftyp: ffmpeg runs (60 frames take 6 s to decode)
    assert ffmpeg_children()
    r.close()
    faulty.wait_for("ffmpeg reaped", lambda: not ffmpeg_children(), timeout=10)
    faulty.wait_for("the decode stops", lambda: _stable(805.0), timeout=30)
    assert len(faulty.decoded(805.0)) < frames


def _stable(tag: float) -> bool:
    n = len(faulty.decoded(tag))
    time.sleep(0.5)
    return len(faulty.decoded(tag)) == n


def test_an_unknown_tensor_layout_is_refused_before_the_body_is_read(url):
    z = latent(*LATENT)
    status, _, body = raw_post(url, f"/decode/{MODEL}", z, {"output_type": "pt"},
                               {"X-Tensor-Layout": "TCHW"})  # fmt: skip
    assert status == 422
    assert json.loads(body) == {"error": "X-Tensor-Layout 'TCHW' is not a tensor layout",
                                "expected": "BCTHW or BTCHW"}  # fmt: skip


@pytest.mark.parametrize("height", [3, 7])
def test_a_4d_latent_to_a_video_model_is_an_mp4_of_one_frame(url, height):
    """A 4-D latent is one latent frame: the MP4's ``x-frames`` said ``frames_out(H)``."""
    z = latent(1, 16, height, 4, seed=height)
    r = requests.post(f"{url}/decode/{MODEL}", params=query(z, output_type="mp4"),
                      data=wire(z), headers={"Content-Type": "tensor/binary"},
                      timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.headers["x-frames"] == "1", r.headers
