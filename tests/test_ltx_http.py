"""LTX-Video through a real uvicorn server on loopback: the issue's "done when".

Two tiny random ``AutoencoderKLLTXVideo`` models are ``save_pretrained`` into diffusers
folders and imported with the real CLI (``python -m app import ltx FOLDER --name ...``):

* ``ltx-091``: the 0.9.1 topology (timestep conditioning, noise injection in three blocks,
  residual 2x upsamplers, patch 4), with non-trivial latent mean/std;
* ``ltx-odd``: patch 3 and no upsampler, the only kind of LTX config whose frames can have
  an odd size (every upsampler doubles H and W, so with one the size is even whatever the
  patch).

diffusers' own ``remote_decode`` is the client wherever it can be (it has no ``timestep``,
``seed`` or ``fps`` argument: those go over plain ``requests``); diffusers' decode of the same
latent, with the same weights, is the oracle. Its noise comes from the global RNG, so the
oracle seeds that with the request's seed (the service's default seed is 0, its default
timestep 0.0: a diffusers folder has no ``decode_timestep``).
"""

from __future__ import annotations

import io
import re
import time
from functools import partial

import numpy as np
import pytest
import requests
import torch
from diffusers import AutoencoderKLLTXVideo
from diffusers.pipelines.ltx.pipeline_ltx import LTXPipeline
from diffusers.utils.remote_utils import remote_decode
from diffusers.video_processor import VideoProcessor
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from app.media import mp4
from tests import helpers
from tests.helpers import (
    MP4_MIN_PSNR,
    diffusers_frames,
    latent,
    ltx_decode,
    probe,
    psnr,
    read_mp4,
    served_ltx,
)
from tests.live import import_pretrained, live_server, post, tensor_of, timed_phases
from tests.test_ltx import ENCODER, LATENT_CHANNELS, V091_BLOCKS

# pt answers against the oracle: same shape, float32 on the wire, cos >= 0.99999
check = partial(helpers.check, dtype=torch.float32)

C = LATENT_CHANNELS
MODELS = {
    "ltx-091": dict(
        **V091_BLOCKS, timestep_conditioning=True, decoder_inject_noise=(True, True, True, False)
    ),
    "ltx-odd": dict(
        decoder_block_out_channels=(8, 8, 8),
        decoder_layers_per_block=(1, 1, 1, 1),
        decoder_spatio_temporal_scaling=(False, False, False),
        decoder_inject_noise=(True, False, True, False),
        upsample_residual=(False, False, False),
        upsample_factor=(1, 1, 1),
        timestep_conditioning=True,
        patch_size=3,
    ),
}
pytestmark = [
    # remote_decode warns that do_scaling is deprecated whenever it sends it (its default)
    pytest.mark.filterwarnings("ignore:`do_scaling` is deprecated:FutureWarning"),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(base URL, {name: diffusers oracle}): both models imported by the CLI, then served."""
    store = tmp_path_factory.mktemp("ltx") / "store"
    oracles = {
        name: served_ltx(AutoencoderKLLTXVideo, 20 + i, latent_channels=C, **ENCODER, **kwargs)
        for i, (name, kwargs) in enumerate(MODELS.items())
    }
    import_pretrained(store, "ltx", oracles)
    with live_server(store, dtype="float32", device="cpu") as url:
        yield url, oracles


def phase_counts(url: str, model: str) -> dict[str, float]:
    """vae_phase_seconds observation counts of ``model``, by phase."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    counts = {}
    for family in text_string_to_metric_families(text):
        if family.name != "vae_phase_seconds":
            continue
        for s in family.samples:
            if s.name.endswith("_count") and s.labels.get("model") == model:
                counts[s.labels["phase"]] = s.value
    return counts


STAGES = {"conv_in", "mid", "up_0", "up_1", "up_2", "conv_out"}


# --- the tests ----------------------------------------------------------------------------
def test_served(world):
    url, _ = world
    assert requests.get(f"{url}/readyz", timeout=5).status_code == 200
    body = requests.get(f"{url}/models", timeout=5).json()
    models = {m["name"]: m for m in body["models"]}
    assert set(models) == set(MODELS) and not body["errors"]
    for m in models.values():
        assert m["family"] == "ltx" and not m["fallback"] and m["parity_cosine"] >= 0.99999
        assert m["config"]["timestep_conditioning"] and m["config"]["inject_noise"]
        assert m["config"]["fps"] == 25


def test_mp4_matches_diffusers_frames(world, tmp_path):
    """(a) output_type=mp4 + Accept: video/mp4: 1 + 8(T-1) frames of the right size, at the
    fps param and at the model's default without one, matching diffusers' uint8 frames.
    (g) the stages are in Server-Timing, and /metrics gets them plus an ``encode`` phase."""
    url, oracles = world
    z = latent(1, C, 3, 3, 4, seed=2)
    expected = diffusers_frames(ltx_decode(oracles["ltx-091"], z))
    assert expected.shape == (17, 96, 128, 3)
    before = phase_counts(url, "ltx-091").get("encode", 0)
    timings = []
    for fps in (12, None):
        query = {"output_type": "mp4"} | ({"fps": fps} if fps else {})
        r = post(url, "ltx-091", z, accept="video/mp4", **query)
        assert r.headers["content-type"] == "video/mp4"
        meta, got = read_mp4(r.content, tmp_path)
        assert got.shape == (1 + 8 * (3 - 1), 96, 128, 3)
        assert meta["size"] == (128, 96) and meta["fps"] == (fps or 25)
        quality = psnr(got, expected)
        print(f"mp4 fps={fps}: {quality:.1f} dB vs diffusers' uint8 frames")
        assert quality >= MP4_MIN_PSNR
        timings.append(r.headers["Server-Timing"])
        assert STAGES <= timed_phases(r), r.headers["Server-Timing"]
    # the MP4 is produced while it streams, after the headers left: its encode phase (and
    # the request's metrics) are recorded once the body is done, so poll for them
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        counts = phase_counts(url, "ltx-091")
        if counts.get("encode", 0) >= before + 2:
            break
        time.sleep(0.05)
    assert counts.get("encode", 0) >= before + 2, counts
    assert STAGES | {"parse", "queue", "encode"} <= set(counts), counts
    print("mp4 Server-Timing:", timings[-1])


def test_remote_decode_mp4(world, tmp_path):
    """(b) diffusers' remote_decode(output_type="mp4") (Accept: text/plain, do_scaling on:
    the model's own latent mean/std) gets playable H.264 yuv420p MP4 bytes."""
    url, oracles = world
    z = latent(1, C, 2, 3, 4, seed=3)
    data = remote_decode(f"{url}/decode/ltx-091", z, output_type="mp4", return_type="mp4")
    assert isinstance(data, bytes) and data[4:8] == b"ftyp"
    info = probe(data, tmp_path)
    assert re.search(r"Video: h264 .*yuv420p.*128x96.*25 fps", info), info
    meta, got = read_mp4(data, tmp_path)
    expected = diffusers_frames(ltx_decode(oracles["ltx-091"], z, pipeline=LTXPipeline))
    assert got.shape == expected.shape == (9, 96, 128, 3)
    quality = psnr(got, expected)
    print(f"remote_decode mp4: {quality:.1f} dB vs diffusers' uint8 frames")
    assert quality >= MP4_MIN_PSNR


def test_remote_decode_video_pil(world):
    """(c) remote_decode(processor=VideoProcessor(), output_type="pil"): [T,3,H,W] frames in
    [0,1], turned into PIL frames that equal diffusers' own to one level."""
    url, oracles = world
    z = latent(1, C, 2, 2, 3, seed=4)
    decoded = ltx_decode(oracles["ltx-091"], z)
    endpoint = f"{url}/decode/ltx-091"
    unit = remote_decode(
        endpoint,
        z,
        do_scaling=False,
        processor=VideoProcessor(),
        output_type="pil",
        return_type="pt",
    )
    expected_unit = (decoded[0].permute(1, 0, 2, 3) / 2 + 0.5).clamp(0, 1)
    assert unit.shape == expected_unit.shape == (9, 3, 64, 96) and unit.dtype == torch.float32
    assert (unit - expected_unit).abs().max() <= 1e-4
    frames = remote_decode(
        endpoint, z, do_scaling=False, processor=VideoProcessor(), output_type="pil"
    )
    assert len(frames) == 9 and all(f.size == (96, 64) for f in frames)
    got = np.stack([np.asarray(f) for f in frames]).astype(int)
    diff = np.abs(got - diffusers_frames(decoded)).max()
    print(f"remote_decode video pil: max diff {diff} levels vs diffusers' frames")
    assert diff <= 1


def test_pt_and_timestep(world):
    """(d) output_type=pt: [B,3,T',H',W'] equal to diffusers' decode at the request's
    timestep; another timestep gives another (equally matching) output."""
    url, oracles = world
    vae = oracles["ltx-091"]
    z = latent(2, C, 2, 2, 3, seed=5)
    outs = {}
    for t in (0.05, 0.7):
        r = post(url, "ltx-091", z, output_type="pt", timestep=t)
        outs[t] = tensor_of(r)
        assert outs[t].shape == (2, 3, 9, 64, 96)
        check(f"pt timestep={t}", outs[t], ltx_decode(vae, z, timestep=t))
        # a streamed answer's head leaves with its first frames: the phases until then (the
        # rest, "encode" included, are in its log line and the metrics)
        assert STAGES | {"parse", "queue"} <= timed_phases(r), r.headers["Server-Timing"]
    assert (outs[0.05] - outs[0.7]).abs().max() > 1e-2
    default = tensor_of(post(url, "ltx-091", z, output_type="pt"))
    check("pt default timestep (0.0)", default, ltx_decode(vae, z, timestep=0.0))
    # remote_decode's pt path (do_scaling on: the model's latent mean/std)
    got = remote_decode(f"{url}/decode/ltx-091", z, output_type="pt", return_type="pt")
    check("remote_decode pt do_scaling", got, ltx_decode(vae, z, pipeline=LTXPipeline))


def test_seed_makes_noise_deterministic(world):
    """(e) the same seed gives the same bytes, another seed other noise (diffusers with the
    global RNG seeded alike is the oracle for both)."""
    url, oracles = world
    z = latent(1, C, 2, 2, 3, seed=6)
    a = post(url, "ltx-091", z, output_type="pt", seed=5).content
    assert post(url, "ltx-091", z, output_type="pt", seed=5).content == a
    b = post(url, "ltx-091", z, output_type="pt", seed=6).content
    assert b != a
    first, second = (tensor_of(post(url, "ltx-091", z, output_type="pt", seed=s)) for s in (5, 6))
    assert (first - second).abs().max() > 1e-3
    check("pt seed=5", first, ltx_decode(oracles["ltx-091"], z, seed=5))
    check("pt seed=6", second, ltx_decode(oracles["ltx-091"], z, seed=6))


def test_odd_frame_size(world, tmp_path):
    """(f) patch 3, no upsampler: 15x21 px frames. pt is exact; the MP4 (yuv420p needs even
    sizes) is 16x22, padded by repeating the last row and column; the PNG stays 15x21."""
    url, oracles = world
    vae = oracles["ltx-odd"]
    z = latent(1, C, 3, 7, 9, seed=7)
    decoded = ltx_decode(vae, z)
    got = tensor_of(post(url, "ltx-odd", z, output_type="pt"))
    assert got.shape == (1, 3, 3, 21, 27)
    check("odd pt", got, decoded)
    r = post(url, "ltx-odd", z, output_type="mp4")
    meta, frames = read_mp4(r.content, tmp_path)
    assert frames.shape == (3, 22, 28, 3) and meta["size"] == (28, 22) and meta["fps"] == 25
    expected = diffusers_frames(decoded)
    padded = np.stack([mp4.even_frame(f) for f in expected])
    quality = psnr(frames[:, :21, :27], expected)
    print(f"odd mp4: {quality:.1f} dB vs diffusers' frames, {psnr(frames, padded):.1f} dB padded")
    assert quality >= MP4_MIN_PSNR and psnr(frames, padded) >= MP4_MIN_PSNR
    one = latent(1, C, 1, 5, 7, seed=8)
    image = remote_decode(
        f"{url}/decode/ltx-odd", one, do_scaling=False, output_type="pil", image_format="png"
    )
    assert image.format == "png" and image.size == (21, 15)
    diff = np.abs(np.asarray(image).astype(int) - diffusers_frames(ltx_decode(vae, one))[0]).max()
    assert diff <= 1


def test_single_frame_as_png(world):
    """(f) one latent frame decodes to one frame, and may be asked for as an image."""
    url, oracles = world
    z = latent(1, C, 1, 3, 4, seed=9)
    expected = diffusers_frames(ltx_decode(oracles["ltx-091"], z))
    assert expected.shape == (1, 96, 128, 3)
    image = remote_decode(
        f"{url}/decode/ltx-091", z, do_scaling=False, output_type="pil", image_format="png"
    )
    assert isinstance(image, Image.Image) and image.format == "png" and image.size == (128, 96)
    diff = np.abs(np.asarray(image).astype(int) - expected[0]).max()
    print(f"single frame png: max diff {diff} levels vs diffusers")
    assert diff <= 1
    r = post(url, "ltx-091", z, image_format="png")  # the plain request, no Accept
    assert r.headers["content-type"] == "image/png"
    assert STAGES <= timed_phases(r)
    # a 4-D image latent [B,C,H,W] is the same single frame
    r = post(url, "ltx-091", z[:, :, 0], image_format="png")
    assert r.headers["content-type"] == "image/png" and r.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(r.content))), np.asarray(image))
