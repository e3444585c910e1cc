"""Request bodies: limits while they stream, declared sizes refused before they are sent,
slow uploads, per-model limits from the manifest, and never a pickle."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import numpy as np
import requests

from tests import faulty
from tests.helpers import (
    faulty_family,
    faulty_server,
    faulty_store,
    post,
    raw_request,
    read_response,
)

__all__ = ["faulty_family", "faulty_server", "faulty_store"]  # module-scoped fixtures


def test_a_chunked_body_over_the_limit_is_refused_while_it_streams(server):
    sock = raw_request(
        server, "/decode/faulty?shape=[1,4,4,4]", headers={"Transfer-Encoding": "chunked"}
    )
    chunk = b"\0" * 65536
    for _ in range(17):  # 1.06 MiB of a 1 MiB limit; no terminating chunk is ever sent
        sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
    status, body = read_response(sock)
    assert status == 413 and "limit" in body["error"]


def test_a_declared_oversize_body_is_refused_before_it_is_sent(server):
    sock = raw_request(
        server, "/decode/faulty?shape=[1,4,4,4]", headers={"Content-Length": "5000000"}
    )
    assert read_response(sock)[0] == 413  # no body byte was sent
    target = "/decode/faulty?shape=[1,4,1024,1024]"
    sock = raw_request(server, target, headers={"Transfer-Encoding": "chunked"})
    status, body = read_response(sock)
    assert status == 413 and "shape" in body["error"]


def test_the_413_names_the_limit_its_setting_and_what_to_send_instead(server):
    """Issue 36.2: a body over the limit is told the limit in bytes, the setting behind it,
    and the way around it (a decode: a half-precision latent or fewer rows)."""
    sock = raw_request(
        server, "/decode/faulty?shape=[1,4,4,4]", headers={"Content-Length": "5000000"}
    )
    status, body = read_response(sock)
    assert status == 413
    assert body["error"] == (
        "a body of 5000000 bytes exceeds the limit of 1048576 bytes (VAE_MAX_BODY_MB=1)"
    )
    assert "bfloat16 or float16" in body["expected"] and "fewer batch rows" in body["expected"]
    sock = raw_request(
        server, "/decode/faulty?shape=[1,4,4,4]", headers={"Transfer-Encoding": "chunked"}
    )
    for _ in range(17):
        sock.sendall(b"%x\r\n" % 65536 + b"\0" * 65536 + b"\r\n")
    status, body = read_response(sock)
    assert status == 413 and "chunked body of" in body["error"]
    assert "exceeds the limit of 1048576 bytes (VAE_MAX_BODY_MB=1)" in body["error"]
    # a raw shape declared too large: refused before the body, with the same way around
    target = "/decode/faulty?shape=[1,4,1024,1024]&dtype=float32"
    status, body = read_response(raw_request(server, target, headers={"Content-Length": "0"}))
    assert status == 413 and "VAE_MAX_BODY_MB" in body["error"], body
    assert "float16" in body["expected"]


def test_the_413_of_an_encode_and_on_cloud_run(tmp_path):
    """An encode's 413 points at the compressed inputs (an image, an MP4), and under
    ``VAE_PLATFORM=cloud-run`` the message names Cloud Run's 32 MiB request limit."""
    from starlette.requests import Request

    from app.config import Settings
    from app.http.body import body_too_large

    def refusal(path: str, **settings) -> dict:
        app = type("App", (), {})()
        app.state = type("State", (), {"settings": Settings(models_dir=tmp_path, **settings)})()
        scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
                 "headers": [], "app": app}  # fmt: skip
        limit = app.state.settings.max_body_mb << 20
        return body_too_large(Request(scope), "a body of 40000000 bytes", limit).body()

    body = refusal("/encode/flux", platform="cloud-run")
    assert body["error"] == (
        "a body of 40000000 bytes exceeds the limit of 32505856 bytes (VAE_MAX_BODY_MB=31, "
        "below Cloud Run's 32 MiB limit on HTTP/1 requests)"
    )
    assert "PNG, JPEG or WebP" in body["expected"] and "MP4" in body["expected"]
    assert "raw pixel tensor" in body["expected"]
    body = refusal("/decode/flux")
    assert "Cloud Run" not in body["error"] and "VAE_MAX_BODY_MB=256" in body["error"]
    assert "bfloat16" in body["expected"]


def test_a_body_that_trickles_in_times_out_with_408(server):
    sock = raw_request(server, "/decode/faulty?shape=[1,4,4,4]", headers={"Content-Length": "256"})
    sock.sendall(b"\0" * 10)
    t0 = time.perf_counter()
    status, body = read_response(sock)
    assert status == 408 and "did not arrive" in body["error"]
    assert time.perf_counter() - t0 < 5


def test_per_model_limits_come_from_the_manifest(server):
    big = faulty.latent(size=8)  # 64x64 output pixels
    assert post(server, big, model="faulty").status_code == 200
    r = post(server, big, model="faulty-small")
    assert r.status_code == 413 and "1024 pixels" in r.json()["error"]
    assert post(server, faulty.latent(size=4), model="faulty-small").status_code == 200


def test_a_pickled_npy_body_is_refused_unread(server, tmp_path):
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    buf = io.BytesIO()
    np.save(buf, np.array([Payload()], dtype=object), allow_pickle=True)
    r = requests.post(
        f"{server}/decode/faulty",
        data=buf.getvalue(),
        headers={"Content-Type": "application/x-npy"},
        timeout=10,
    )
    assert r.status_code == 422 and "dtype" in r.json()["error"]
    assert not marker.exists()


def test_no_pickle_on_the_request_or_load_path():
    """Only safetensors and header-checked .npy are read; ``torch.load`` only at import."""
    app = Path(__file__).resolve().parents[1] / "app"
    for path in app.rglob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "allow_pickle=True" not in text, path
        assert "np.load(" not in text, path
        for call in _calls(text, "torch.load("):
            assert "weights_only=True" in call, (path, call)


def _calls(text: str, opening: str) -> list[str]:
    """The full text of each call ``opening...)``, nested parentheses included."""
    calls = []
    for match in re.finditer(re.escape(opening), text):
        depth, end = 0, match.start()
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        calls.append(text[match.start() : end + 1])
    return calls
