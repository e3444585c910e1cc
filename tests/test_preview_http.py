"""``output_type=preview`` against a live server: the published latent-to-RGB map answered
without the decode queue (milliseconds of server time), one frame of a video latent, and a
422 naming the formats for a model whose latents have no published factors."""

from __future__ import annotations

import io
import json
import re
import threading

import numpy as np
import pytest
import requests
import torch
from PIL import Image

from app.families.minimax_h3 import decoder as minimax_h3
from app.families.wan import decoder as wan
from app.media.preview import FORMATS, preview
from tests.live import TINY_FLUX, bake, live_server

SERVER_MS = 50  # the brief's bound on a preview's server time (Server-Timing total)


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    store = tmp_path_factory.mktemp("preview-store")
    bake(store, "flux", "flux-tiny", TINY_FLUX["flux-tiny"])
    bake(store, "flux", "sd-tiny", TINY_FLUX["sd-tiny"])
    # a manifest's own choice wins over the family's channel mapping
    bake(store, "flux", "sd3-tiny", {**TINY_FLUX["flux-tiny"], "preview_format": "sd3"})
    bake(store, "wan", "wan2.1-tiny", wan.SYNTHETIC["wan2.1-tiny"])
    bake(store, "minimax-h3", "minimax-tiny", minimax_h3.SYNTHETIC["minimax-h3-tiny"])
    # manifests naming no published format, or one for other latents: refused, not a 500
    bake(store, "flux", "bogus-tiny", {**TINY_FLUX["sd-tiny"], "preview_format": "sd9"})
    bake(store, "flux", "mismatched-tiny", {**TINY_FLUX["sd-tiny"], "preview_format": "flux1"})
    with live_server(store, device="cpu", dtype="float32") as base:
        yield base


def latent(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def ask(url: str, model: str, z: torch.Tensor, **params) -> requests.Response:
    query = {"shape": json.dumps(list(z.shape)), "dtype": "float32", "output_type": "preview"}
    query.update({k: str(v) for k, v in params.items()})
    return requests.post(
        f"{url}/decode/{model}",
        params=query,
        data=z.numpy().tobytes(),
        headers={"Content-Type": "tensor/binary"},
        timeout=60,
    )


def pixels(r: requests.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.asarray(Image.open(io.BytesIO(r.content)).convert("RGB"))


def server_ms(r: requests.Response) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"(\w+);dur=([\d.]+)", r.headers["server-timing"])}


def test_a_flux_latent_previews_as_a_png_of_its_size_in_milliseconds(url):
    z = latent(1, 16, 128, 96)  # a 768x1024 image's latent
    ask(url, "flux-tiny", z)  # warm: the first request imports the encoders
    runs = [ask(url, "flux-tiny", z)]
    while server_ms(runs[-1])["total"] >= SERVER_MS and len(runs) < 10:
        runs.append(ask(url, "flux-tiny", z))  # the best of a few: a loaded host's noise
    r = runs[0]
    assert r.headers["content-type"] == "image/png" and r.headers["x-output"] == "preview"
    got = pixels(r)
    assert got.shape == (128, 96, 3)  # latent resolution
    assert np.array_equal(got, preview("flux1", z)[0])  # PNG is lossless: the exact map
    timings = [server_ms(run) for run in runs]
    assert set(timings[0]) == {"parse", "preview", "total"}  # no queue, no decoder phases
    assert min(t["total"] for t in timings) < SERVER_MS, timings


def test_the_latent_is_previewed_as_sent_whatever_the_scaling_params(url):
    """The factors apply to the sampler's latent: do_scaling and explicit factors (which
    describe the decoder's de-normalization) change nothing."""
    z = latent(1, 16, 16, 16, seed=1)
    plain = pixels(ask(url, "flux-tiny", z))
    assert np.array_equal(pixels(ask(url, "flux-tiny", z, do_scaling="true")), plain)
    scaled = ask(url, "flux-tiny", z, scaling_factor=0.3611, shift_factor=0.1159)
    assert np.array_equal(pixels(scaled), plain)


def test_the_format_follows_the_model(url):
    z4 = latent(1, 4, 8, 8, seed=2)
    assert np.array_equal(pixels(ask(url, "sd-tiny", z4)), preview("sd1.5", z4)[0])
    z16 = latent(1, 16, 8, 8, seed=3)
    assert np.array_equal(pixels(ask(url, "sd3-tiny", z16)), preview("sd3", z16)[0])
    assert not np.array_equal(preview("sd3", z16), preview("flux1", z16))


def test_a_packed_flux_latent_previews_as_its_unpacked_one(url):
    z = latent(1, 16, 16, 24, seed=4)
    packed = z.view(1, 16, 8, 2, 12, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, 96, 64)
    r = ask(url, "flux-tiny", packed, height=128, width=192)
    assert np.array_equal(pixels(r), preview("flux1", z)[0])


@pytest.mark.parametrize(("fmt", "mime"), [("jpg", "image/jpeg"), ("webp", "image/webp")])
def test_jpeg_and_webp_previews(url, fmt, mime):
    r = ask(url, "flux-tiny", latent(1, 16, 16, 16), image_format=fmt)
    assert r.headers["content-type"] == mime and pixels(r).shape == (16, 16, 3)


def test_a_video_latent_previews_one_frame(url):
    z = latent(1, 16, 4, 8, 10, seed=5)
    first = pixels(ask(url, "wan2.1-tiny", z))
    assert first.shape == (8, 10, 3)  # one image, not an MP4
    assert np.array_equal(first, preview("wan2.1", z, frame=0)[0])
    last = pixels(ask(url, "wan2.1-tiny", z, frame=-1))
    assert np.array_equal(last, preview("wan2.1", z, frame=3)[0])
    assert not np.array_equal(first, last)
    r = ask(url, "wan2.1-tiny", z, frame=4)
    assert r.status_code == 422 and "out of range for 4 latent frames" in r.json()["error"]


@pytest.mark.parametrize(
    ("model", "z"),
    [
        ("minimax-tiny", latent(1, 24, 2, 2, 2)),
        ("bogus-tiny", latent(1, 4, 2, 2)),
        ("mismatched-tiny", latent(1, 4, 2, 2)),
    ],
)
def test_a_model_without_published_factors_is_refused_naming_the_formats(url, model, z):
    r = ask(url, model, z)
    assert r.status_code == 422, r.text
    body = r.json()
    assert model in body["error"] and "no published preview factors" in body["error"]
    assert all(key in body["expected"] for key in FORMATS)


def test_the_python_client_asks_for_a_preview_with_output_type(url):
    from vae_client import Client

    z = latent(1, 16, 8, 12, seed=6).numpy()
    with Client(url) as client:
        png = client.decode(z, "flux-tiny", "png", output_type="preview")
        assert set(client.last_timings) == {"parse", "preview", "total"}
    got = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    assert np.array_equal(got, preview("flux1", z)[0])


def test_what_a_preview_cannot_be_is_refused(url):
    r = ask(url, "flux-tiny", latent(2, 16, 8, 8))
    assert r.status_code == 422 and "batch of 2" in r.json()["error"]
    r = ask(url, "flux-tiny", latent(1, 16, 8, 8), frame=0)  # frame is for video latents
    assert r.status_code == 422 and "frame" in r.json()["error"]
    z = latent(1, 16, 2, 8, 8)
    r = ask(url, "wan2.1-tiny", z, output_type="pt", frame=1)  # frame is for previews
    assert r.status_code == 422 and "frame" in r.json()["error"]
    r = ask(url, "flux-tiny", latent(1, 4, 8, 8))
    assert r.status_code == 422 and "channels" in r.json()["error"]


def test_previews_are_counted_under_their_own_output_label(url):
    ask(url, "flux-tiny", latent(1, 16, 8, 8))
    metrics = requests.get(f"{url}/metrics", timeout=10).text
    counted = r'vae_requests_total\{code="200",model="flux-tiny",output="preview"\} [1-9]'
    assert re.search(counted, metrics)
    assert 'kind="preview"' in metrics
    assert re.search(r'vae_phase_seconds_count\{[^}]*phase="preview"', metrics)


def test_a_preview_is_answered_while_the_worker_is_busy_and_the_queue_full(tmp_path):
    """No queue, no worker: with the one worker held and the queue full, a decode gets 429
    and a preview of the same model its image (a manifest's ``preview_format`` names it)."""
    from tests import faulty
    from tests.helpers import occupy, post, wait_queued

    with faulty.registered():
        faulty.bake(tmp_path, "faulty", preview_format="sd1.5")
        with live_server(tmp_path, device="cpu", dtype="float32", queue_depth=1) as base:
            held = occupy(base, 7.0)
            queued = threading.Thread(target=post, args=(base, faulty.latent(tag=8.0)))
            try:
                queued.start()
                wait_queued(base, 1)
                assert post(base, faulty.latent(tag=9.0)).status_code == 429
                z = latent(1, 4, 8, 8, seed=7)
                r = ask(base, "faulty", z)
                assert np.array_equal(pixels(r), preview("sd1.5", z)[0])
                assert "queue" not in server_ms(r)
            finally:
                faulty.release(7.0)
                held.join(30)
                queued.join(30)
