"""The request log (issue 35.3, 36.11): one line per request, with its id, in both formats;
no secret a client sent in the URL or a header reaches any line; probes and scrapes at DEBUG.

A real ``python -m app serve`` writes the log; the test reads the file it wrote.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests

from app.telemetry.logs import redact
from tests import faulty
from tests.live import TINY_FLUX, bake

SECRETS = ("s3cr3t-query-token", "s3cr3t-access", "s3cr3t-api-key", "s3cr3t-bearer")
TOKEN = "the-right-token"


@pytest.mark.parametrize(
    ("line", "secret"),
    [
        ("POST /decode/m?shape=1&token=abc123&dtype=float32 401", "abc123"),
        ("GET /models?access_token=abc123", "abc123"),
        ("GET /models?X-Api-Key=abc123#frag", "abc123"),
        ('{"requestUrl":"/x?password=abc123"}', "abc123"),
        ("GET /models?sig=abc123;shape=1", "abc123"),
        ("Authorization: Bearer abc123.def", "abc123"),
    ],
)
def test_redact_removes_credentials_and_keeps_the_rest(line, secret):
    out = redact(line)
    assert secret not in out and "REDACTED" in out
    if "?" in line:
        assert out.split("?")[0] == line.split("?")[0]  # the path stays readable


def test_redact_leaves_protocol_params_alone():
    url = "/decode/m?shape=1&dtype=float32&output_type=pil&scaling_factor=0.3&seed=4&timestep=1"
    assert redact(url) == url


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("log-store")
    bake(store, "flux", "flux-tiny", TINY_FLUX["flux-tiny"])
    return store


def _requests(url: str) -> list[str]:
    """A refused query token, a refused header token, an accepted request carrying a key in
    its query, a decode, a probe and a scrape; the request ids of the non-probe ones."""
    ids = []
    r = requests.get(f"{url}/models?token={SECRETS[0]}", timeout=30)
    assert r.status_code == 401
    ids.append(r.headers["x-request-id"])
    r = requests.post(
        f"{url}/decode/flux-tiny?shape=[1,16,2,2]&access_token={SECRETS[1]}",
        headers={"Authorization": f"Bearer {SECRETS[3]}"},
        data=b"\0" * 256,
        timeout=30,
    )
    assert r.status_code == 401
    ids.append(r.headers["x-request-id"])
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = requests.get(f"{url}/openapi.json?api_key={SECRETS[2]}", headers=auth, timeout=30)
    assert r.status_code == 200
    ids.append(r.headers["x-request-id"])
    r = requests.post(
        f"{url}/decode/flux-tiny?shape=[1,16,2,2]&dtype=float32&output_type=pt",
        headers={**auth, "Content-Type": "tensor/binary"},
        data=b"\0" * 256,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    ids.append(r.headers["x-request-id"])
    assert requests.get(f"{url}/metrics", timeout=30).status_code == 200
    assert requests.get(f"{url}/healthz", timeout=30).status_code == 200
    time.sleep(0.3)  # the last request line is written
    return ids


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_one_line_per_request_with_its_id_and_no_secret(store, tmp_path, fmt):
    log = tmp_path / "serve.log"
    env = {"VAE_LOG_FORMAT": fmt, "VAE_API_TOKENS": TOKEN}
    with faulty.serve_process(store, log, **env) as (url, _):
        ids = _requests(url)
    text = log.read_text()
    for secret in SECRETS:
        assert secret not in text, f"{secret} logged:\n{text[-3000:]}"
    lines = text.splitlines()
    for rid in ids:
        assert len([line for line in lines if rid in line]) == 1, (rid, text[-3000:])
    # no uvicorn access line ('127.0.0.1:PORT - "GET /models HTTP/1.1" 401'), no probe or
    # scrape at INFO (the start polls /readyz many times)
    assert not [line for line in lines if 'HTTP/1.1" ' in line]
    for quiet in ("/readyz", "/healthz", "/metrics"):
        assert quiet not in text, f"{quiet} logged at INFO:\n{text[-2000:]}"
    if fmt == "json":
        requests_logged = [json.loads(line) for line in lines if '"httpRequest"' in line]
        assert {entry["request_id"] for entry in requests_logged} >= set(ids)
