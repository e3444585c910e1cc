"""Video encodes on the worker (issue 35.5, 35.7): an encode runs chunk by chunk and the worker
serves queued requests between its chunks, so a small request waits about one chunk, not a
whole video; an MP4 body is decoded as the encoder reads its windows, so its pixels are never
all in memory, whatever the body's size says.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from app.families import family
from app.media.mp4 import encode_mp4
from app.store import write_model
from tests import faulty
from tests.live import live_server

MODEL = "wan2.1-tiny"


def bake_wan(store: Path) -> None:
    import torch

    described, recipe = family("wan"), family("wan").synthetic[MODEL]
    decoder = described.decoder.module(recipe.config)
    described.decoder.init_synthetic(decoder, torch.Generator().manual_seed(0))
    encoder = described.encoder.module(recipe.encoder_config)
    described.encoder.init_synthetic(encoder, torch.Generator().manual_seed(1))
    write_model(store, MODEL, "wan", recipe.config, decoder.state_dict(), "test", "float32",
                encoder.state_dict(), recipe.encoder_config)  # fmt: skip


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("encode-streams")
    bake_wan(store)
    return store


def phase_ms(response: requests.Response, name: str) -> float:
    for part in response.headers["Server-Timing"].split(","):
        key, _, value = part.strip().partition(";dur=")
        if key == name:
            return float(value)
    return 0.0


def test_a_small_decode_waits_one_chunk_of_a_long_video_encode_not_the_video(store):
    frames, side = 161, 128  # 1 + 16 chunks of 10 frames: the encode runs 16 chunks
    clip = np.random.default_rng(0).uniform(-1, 1, (1, 3, frames, side, side)).astype(np.float32)
    with live_server(store, device="cpu", dtype="float32") as url:
        done: dict[str, requests.Response] = {}

        def encode() -> None:
            done["encode"] = requests.post(
                f"{url}/encode/{MODEL}",
                params={"shape": json.dumps(list(clip.shape)), "dtype": "float32"},
                data=clip.tobytes(),
                headers={"Content-Type": "tensor/binary"},
                timeout=300,
            )

        big = threading.Thread(target=encode)
        big.start()
        faulty.wait_for("the encode running", lambda: _inflight(url) >= 1, 120)
        time.sleep(0.2)  # into its chunks
        z = np.zeros((1, 16, 4, 4), np.float32)
        small = requests.post(
            f"{url}/decode/{MODEL}",
            params={"shape": json.dumps(list(z.shape)), "output_type": "pt"},
            data=z.tobytes(),
            headers={"Content-Type": "tensor/binary"},
            timeout=120,
        )
        answered_while_encoding = big.is_alive()
        big.join(300)
    assert small.status_code == 200 and done["encode"].status_code == 200, done["encode"].text
    assert answered_while_encoding, "the small decode waited for the whole encode"
    chunks = 1 + (frames - 1) // 10 + 1  # the stream's chunks, with margin for the first
    chunk_ms = phase_ms(done["encode"], "total") / chunks
    assert phase_ms(small, "queue") < 3 * chunk_ms, (phase_ms(small, "queue"), chunk_ms)


def _inflight(url: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    values = [
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("vae_inflight")
    ]
    return max(values, default=0.0)


def test_an_mp4_is_never_whole_in_memory(store, tmp_path):
    """A 1025-frame MP4 of 64x64 is 48 MiB of float32 pixels; its body is a few hundred KB.
    Once a short MP4 has warmed the server (the conv kernels, the allocator), the long one
    grows the server's resident memory by less than its pixels: the encoder reads the clip
    window by window (the old reader held it whole, twice over, as uint8 and as float32)."""
    side = 64
    base = np.random.default_rng(1).integers(0, 255, (side, side, 3), dtype=np.uint8)

    def mp4(frames: int) -> bytes:
        return b"".join(encode_mp4((np.roll(base, t, axis=1) for t in range(frames)), fps=24))

    frames = 1025
    pixels_mb = frames * 3 * side * side * 4 / 2**20
    env = {"VAE_MAX_FRAMES": str(frames), "VAE_SERVE_ENCODERS": "true"}
    with faulty.serve_process(store, tmp_path / "serve.log", **env) as (url, proc):
        warm = _encode_mp4(url, mp4(33))
        assert warm.status_code == 200, warm.text
        before = faulty.rss_bytes(proc.pid)
        peak = _sampled(proc.pid, lambda: _encode_mp4(url, mp4(frames)))
    response, highest = peak
    assert response.status_code == 200, response.text
    assert json.loads(response.headers["shape"])[2] == 1 + (frames - 1) // 4
    grown_mb = (highest - before) / 2**20
    assert grown_mb < pixels_mb, f"grew {grown_mb:.0f} MiB for {pixels_mb:.0f} MiB of pixels"


def _encode_mp4(url: str, body: bytes) -> requests.Response:
    return requests.post(
        f"{url}/encode/{MODEL}", data=body, headers={"Content-Type": "video/mp4"}, timeout=600
    )


def _sampled(pid: int, work) -> tuple[requests.Response, int]:
    """``work()``'s result and the process's highest resident memory while it ran."""
    peak, stop = [faulty.rss_bytes(pid)], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak.append(faulty.rss_bytes(pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        return work(), max(peak)
    finally:
        stop.set()
        sampler.join()


def test_an_ltx_clip_of_a_frame_count_its_encoder_refuses_is_a_422_naming_the_rule(tmp_path):
    import torch

    store = tmp_path / "store"
    described, recipe = family("ltx"), family("ltx").synthetic["ltx-tiny"]
    decoder = described.decoder.module(recipe.config)
    encoder = described.encoder.module(recipe.encoder_config)
    described.encoder.init_synthetic(encoder, torch.Generator().manual_seed(1))
    write_model(store, "ltx-tiny", "ltx", recipe.config, decoder.state_dict(), "test", "float32",
                encoder.state_dict(), recipe.encoder_config)  # fmt: skip
    frames = [np.full((64, 64, 3), 16 * t, np.uint8) for t in range(8)]  # an ordinary 8 frames
    body = b"".join(encode_mp4(iter(frames), fps=8))
    with live_server(store, device="cpu", dtype="float32") as url:
        r = requests.post(
            f"{url}/encode/ltx-tiny", data=body, headers={"Content-Type": "video/mp4"}, timeout=120
        )
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert "encoder" in error and "8 frames" in error and "1 + 8k" in error, error
