"""The page for people (``GET /``, app/http/page.py) in a real headless Chromium.

A live uvicorn server on loopback with bearer auth on, serving a tiny FLUX.1 entry with its
encoder and the synthetic ``wan2.1-tiny`` video decoder; Debian's ``/usr/bin/chromium``, driven
by Playwright (``executable_path``: never ``playwright install``, the machine is offline) with a
fresh profile. The page must load with no console error and no request to another origin, list
the models with their state once its token is typed in, encode an image and decode it back with
a PSNR that matches the one this test computes from the same two images, decode a ``.npy``
latent to an image and a ``.safetensors`` video latent to a playing ``<video>``, and show a refusal's ``error``
and ``expected``. It leaves a screenshot (``page.png`` in the test's tmp folder; the one in
docs/page.png is such a screenshot).

Needs ``bash scripts/install_ci_deps.sh`` (Debian's chromium, PyPI's playwright): skips without.
"""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from PIL import Image, ImageDraw
from safetensors.numpy import save_file

from app.families import family
from app.http.auth import OPEN_PATHS
from app.http.page import ASSETS, PAGE_CSP, PAGE_PATHS
from app.store import write_model
from tests.live import TINY_FLUX, live_server

CHROMIUM = Path("/usr/bin/chromium")
# headless=True adds --headless; the rest keeps an offline browser from reaching for the network
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TOKEN = "page-test-token"
# how often the page polls /models (page.js)
PAGE_JS = (Path(__file__).parent.parent / "app" / "http" / "page" / "page.js").read_text()
REFRESH_MS = int(PAGE_JS.split("const REFRESH_MS = ", 1)[1].split(";", 1)[0])
IMAGE_MODEL, VIDEO_MODEL = "flux-tiny", "wan2.1-tiny"
HAVE_ENOUGH_DATA = 4  # HTMLMediaElement.readyState
TIMEOUT_MS = 120_000


def _missing() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing: run `bash scripts/install_ci_deps.sh` (Debian's chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: run `bash scripts/install_ci_deps.sh`"
    return None


pytestmark = [
    pytest.mark.skipif(_missing() is not None, reason=str(_missing())),
]


def _write(store: Path, name: str, key: str, config: dict, encoder_config: dict | None) -> None:
    """One seeded entry, as ``python -m app bake`` writes it (the encoder when one is given)."""
    described = family(key)
    decoder = described.decoder.module(config)
    described.decoder.init_synthetic(decoder, torch.Generator().manual_seed(0))
    encoder_state = None
    if encoder_config is not None:
        encoder = described.encoder.module(encoder_config)
        described.encoder.init_synthetic(encoder, torch.Generator().manual_seed(1))
        encoder_state = encoder.state_dict()
    write_model(
        store,
        name,
        key,
        config,
        decoder.state_dict(),
        source="test",
        dtype="float32",
        encoder_state=encoder_state,
        encoder_config=encoder_config,
    )


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    store = tmp_path_factory.mktemp("page-store")
    _write(store, IMAGE_MODEL, "flux", TINY_FLUX["flux-tiny"], TINY_FLUX["flux-tiny"])
    _write(store, VIDEO_MODEL, "wan", family("wan").synthetic[VIDEO_MODEL].config, None)
    with live_server(store, dtype="float32", api_tokens=TOKEN) as url:
        yield url


def _picture() -> bytes:
    """A 192x128 PNG (a multiple of 8: the service does not resize it, so the page's PSNR and
    this test's see the same pixels)."""
    image = Image.new("RGB", (192, 128), (24, 48, 110))
    draw = ImageDraw.Draw(image)
    for x in range(0, 192, 8):
        draw.line([(x, 0), (191 - x, 127)], fill=(255 - x, x, 140))
    draw.ellipse([56, 24, 136, 104], fill=(245, 200, 40))
    draw.rectangle([8, 96, 48, 120], fill=(230, 60, 60))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def _rgb(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_page_and_assets_are_open_with_their_own_csp(url):
    """``/`` and its assets answer without a token and carry the page's CSP (no CDN, blob:
    media); the API behind them still needs the token."""
    assert PAGE_PATHS <= OPEN_PATHS
    page = requests.get(f"{url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["Content-Security-Policy"] == PAGE_CSP
    assert "default-src 'none'" in PAGE_CSP and "http" not in PAGE_CSP
    assert page.headers["X-Frame-Options"] == "DENY"
    for name, media_type in ASSETS.items():
        asset = requests.get(f"{url}/page/{name}", timeout=10)
        assert asset.status_code == 200, name
        assert asset.headers["content-type"] == media_type
        assert asset.headers["Content-Security-Policy"] == PAGE_CSP
    assert requests.get(f"{url}/models", timeout=10).status_code == 401
    assert requests.get(f"{url}/page/other.js", timeout=10).status_code == 401  # not open
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for other in ("index.html", "%2e%2e%2fconfig.py"):  # only the assets, by name
        missing = requests.get(f"{url}/page/{other}", headers=auth, timeout=10)
        assert missing.status_code == 404 and "error" in missing.json(), other
    api = requests.get(f"{url}/healthz", timeout=10)  # the API's own policy is untouched
    assert api.headers["Content-Security-Policy"] == "default-src 'none'; frame-ancestors 'none'"


def test_page_in_chromium(url, tmp_path):
    from playwright.sync_api import sync_playwright

    picture = tmp_path / "picture.png"
    picture.write_bytes(_picture())
    names = ("z.npy", "v.safetensors", "w.npy")
    image_latent, video_latent, wrong_latent = (tmp_path / n for n in names)
    rng = np.random.default_rng(0)
    np.save(image_latent, rng.standard_normal((1, 16, 8, 8), dtype=np.float32))
    video = rng.standard_normal((1, 16, 3, 8, 8), dtype=np.float32)  # 3 latent frames
    save_file({"latent": video}, str(video_latent))
    np.save(wrong_latent, np.zeros((1, 4, 8, 8), dtype=np.float32))

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a fresh user-data-dir
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1200, "height": 900},
        )
        try:
            _drive(browser, url, tmp_path, picture, image_latent, video_latent, wrong_latent)
        finally:
            browser.close()


def _drive(browser, url, tmp_path, picture, image_latent, video_latent, wrong_latent) -> None:
    page = browser.pages[0] if browser.pages else browser.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    requested: list[str] = []
    browser.on("request", lambda r: requested.append(r.url))

    # without the token: the page itself loads, and says the service needs one
    response = page.goto(f"{url}/")
    assert response.status == 200
    assert response.headers["content-security-policy"] == PAGE_CSP
    page.wait_for_selector("#models-status:has-text('needs a token')")
    assert all("401" in e for e in errors), errors  # GET /models refused, nothing else
    refused = len(errors)
    page.wait_for_timeout(REFRESH_MS + 500)  # a poll's time: no 401 more till a token is typed
    assert len(errors) == refused, errors
    page.fill("#token", "not-the-token")  # a wrong one: the service's words, not "needs one"
    page.click("#token-form button[type=submit]")
    page.wait_for_selector("#models-status:has-text('the token was refused')")
    assert "invalid bearer token" in page.inner_text("#models-status")
    page.fill("#token", TOKEN)
    page.click("#token-form button[type=submit]")
    page.wait_for_selector(f'tr[data-model="{IMAGE_MODEL}"]')

    # with the token in sessionStorage: a reload loads with no console error at all
    errors.clear()
    page.reload()
    for model in (IMAGE_MODEL, VIDEO_MODEL):
        page.wait_for_selector(f'tr[data-model="{model}"] td.state-ready')
    rows = {
        r["name"]: r
        for r in page.eval_on_selector_all(
            "#models tbody tr",
            """rows => rows.map(r => ({name: r.dataset.model,
                 state: r.querySelector('td.state').textContent,
                 device: r.querySelector('td.device').textContent,
                 encoder: r.querySelector('td.encoder').textContent}))""",
        )
    }
    assert set(rows) == {IMAGE_MODEL, VIDEO_MODEL}
    assert {r["state"] for r in rows.values()} == {"ready"}
    assert rows[IMAGE_MODEL]["device"] == "cpu" and "exact" in rows[IMAGE_MODEL]["encoder"]
    assert rows[VIDEO_MODEL]["encoder"] == "none"
    assert errors == []

    # the round trip: encode the picture, decode its latent, both shown with the PSNR
    page.set_input_files("#roundtrip input[name=image]", str(picture))
    page.select_option("#roundtrip select[name=model]", IMAGE_MODEL)
    with page.expect_response(lambda r: "/decode/" in r.url) as decoded_answer:
        page.click("#roundtrip button[type=submit]")
    assert decoded_answer.value.status == 200
    assert decoded_answer.value.headers["content-type"] == "image/png"
    page.wait_for_selector("#rt-psnr[data-db]")
    sizes = page.evaluate(
        "['rt-original', 'rt-decoded'].map(id => {"
        " const i = document.getElementById(id); return [i.naturalWidth, i.naturalHeight]; })"
    )
    assert sizes == [[192, 128], [192, 128]]
    # the decoded image as the page shows it is the service's answer to a client that
    # encodes and decodes the same picture itself (so the page sent what a client would)
    decoded = _shown(page, "rt-decoded")
    assert np.array_equal(decoded, _rgb(_round_trip(url, picture.read_bytes())))
    shown = float(page.get_attribute("#rt-psnr", "data-db"))
    ours = _psnr(_rgb(picture.read_bytes()), decoded)
    assert abs(shown - ours) < 0.1, (shown, ours)
    assert page.text_content("#rt-psnr") == f"{shown:.2f}"
    phases = page.text_content("#rt-phases")
    assert "encode (POST /encode/flux-tiny)" in phases and "decode (POST" in phases
    assert "total" in phases
    last = page.wait_for_selector(f'tr[data-model="{IMAGE_MODEL}"] td.last:has-text("total")')
    assert "encode: parse" in last.text_content() and "decode: parse" in last.text_content()
    shot = tmp_path / "page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"page: PSNR {shown:.4f} dB in the page, {ours:.4f} dB here; screenshot {shot}")

    # a latent .npy decoded to an image
    page.set_input_files("#latent input[name=latent]", str(image_latent))
    page.select_option("#latent select[name=model]", IMAGE_MODEL)
    page.click("#latent button[type=submit]")
    page.wait_for_function(
        "() => document.getElementById('lt-image').naturalWidth > 0"
        " || !document.getElementById('latent-error').hidden"
    )
    assert page.is_hidden("#latent-error"), page.text_content("#latent-error")
    assert page.evaluate("document.getElementById('lt-image').naturalWidth") == 64
    assert page.is_hidden("#lt-video")

    # a video latent (.safetensors; "auto" reads its 5-D shape: MP4) to a <video> that plays
    page.set_input_files("#latent input[name=latent]", str(video_latent))
    page.select_option("#latent select[name=model]", VIDEO_MODEL)
    with page.expect_response(lambda r: "/decode/" in r.url) as video_answer:
        page.click("#latent button[type=submit]")
    page.wait_for_function(  # it plays, or the page shows why not
        "() => { const v = document.getElementById('lt-video');"
        f" return (!v.hidden && (v.readyState >= {HAVE_ENOUGH_DATA} || v.duration > 0))"
        " || !document.getElementById('latent-error').hidden; }"
    )
    assert page.is_hidden("#latent-error"), page.text_content("#latent-error")
    assert video_answer.value.headers["content-type"] == "video/mp4"
    video = page.evaluate(
        "(() => { const v = document.getElementById('lt-video');"
        " return {ready: v.readyState, duration: v.duration, src: v.src}; })()"
    )
    assert video["duration"] > 0 and video["src"].startswith("blob:"), video
    assert page.is_hidden("#lt-image")
    assert errors == [], errors

    # a refusal: the JSON body's error and expected, in the page
    page.set_input_files("#latent input[name=latent]", str(wrong_latent))
    page.select_option("#latent select[name=model]", IMAGE_MODEL)
    page.click("#latent button[type=submit]")
    page.wait_for_selector("#latent-error:visible")
    assert page.is_hidden("#latent-result")  # the last decode's video is not this one's
    refusal = _refusal(url, wrong_latent)
    shown_error = page.text_content("#latent-error")
    assert f"422: {refusal['error']}" in shown_error and refusal["expected"] in shown_error
    assert all("422" in e for e in errors), errors  # the refused POST, nothing else

    # every request stayed on the service's origin (blob: URLs are the page's own)
    others = [u for u in requested if not u.startswith((f"{url}/", f"blob:{url}/"))]
    assert others == [], others


def _shown(page, element_id: str) -> np.ndarray:
    """The RGB pixels of an ``<img>`` of the page, as the browser decoded them (drawn on a
    canvas and read back as a lossless PNG: no fetch of its blob: URL, which the page's CSP
    does not allow)."""
    data_url = page.evaluate(
        """id => { const img = document.getElementById(id);
                   const canvas = document.createElement('canvas');
                   canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
                   canvas.getContext('2d').drawImage(img, 0, 0);
                   return canvas.toDataURL('image/png'); }""",
        element_id,
    )
    return _rgb(base64.b64decode(data_url.split(",", 1)[1]))


def _round_trip(url: str, png: bytes) -> bytes:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    latent = requests.post(
        f"{url}/encode/{IMAGE_MODEL}",
        data=png,
        headers={**auth, "Content-Type": "image/png", "Accept": "tensor/binary"},
        timeout=120,
    )
    assert latent.status_code == 200, latent.text
    query = {"shape": latent.headers["shape"], "dtype": latent.headers["dtype"]}
    decoded = requests.post(
        f"{url}/decode/{IMAGE_MODEL}",
        params={**query, "output_type": "pil", "image_format": "png"},
        data=latent.content,
        headers={**auth, "Content-Type": "tensor/binary"},
        timeout=120,
    )
    assert decoded.status_code == 200, decoded.text
    assert json.loads(latent.headers["shape"])[2:] == [16, 24]
    return decoded.content


def _refusal(url: str, latent: Path) -> dict:
    r = requests.post(
        f"{url}/decode/{IMAGE_MODEL}",
        params={"output_type": "pil", "image_format": "png"},
        data=latent.read_bytes(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-npy"},
        timeout=60,
    )
    assert r.status_code == 422, r.text
    return r.json()
