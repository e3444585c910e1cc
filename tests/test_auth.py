"""Auth and what every response carries: bearer tokens, protected metrics, safe headers,
user input never a log format string, the client address from trusted proxies only."""

from __future__ import annotations

import json

import pytest

from app.http.docs import DOCS_CSP
from tests import faulty
from tests.helpers import (
    SERVE_FAULTY,
    client,
    faulty_family,
    faulty_server,
    faulty_store,
    post,
)

__all__ = ["faulty_family", "faulty_server", "faulty_store"]  # module-scoped fixtures


def test_bearer_tokens_guard_everything_but_health(tmp_path):
    c = client(tmp_path, api_tokens="alpha, beta")
    assert c.get("/healthz").status_code == 200
    assert c.get("/readyz").status_code == 503  # not loaded, but not a 401
    assert c.get("/metrics").status_code == 200
    for path in ("/", "/openapi.json", "/docs"):  # static pages: every call they make needs one
        assert c.get(path).status_code == 200, path
    for path in ("/models", "/page/other.js"):
        r = c.get(path)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == 'Bearer realm="vae"'
        assert r.json()["error"] == "missing bearer token" and "X-Request-Id" in r.headers
    r = c.post("/decode/good", content=b"\0" * 64, headers={"Authorization": "Bearer gamma"})
    assert r.status_code == 401 and 'error="invalid_token"' in r.headers["WWW-Authenticate"]
    assert c.get("/models", headers={"Authorization": "Basic YWxwaGE6"}).status_code == 401
    for header in ("Bearer beta", "bearer alpha", "Bearer  alpha "):
        assert c.get("/models", headers={"Authorization": header}).status_code == 200, header


def test_readyz_says_what_failed_only_to_a_caller_with_a_token(tmp_path):
    """A probe needs no token, and gets the status and a reason; the models, their errors
    (here the empty store's path) and states only with one, or where no token is configured."""
    from fastapi.testclient import TestClient

    from app.config import Settings
    from app.http import create_app

    def loaded(**settings) -> TestClient:
        app = create_app(Settings(models_dir=tmp_path, **settings), load_in_background=False)
        return TestClient(app)

    with loaded(api_tokens="alpha") as c:
        for header in (None, "Bearer gamma"):
            anonymous = c.get("/readyz", headers={"Authorization": header} if header else {})
            body = anonymous.json()
            assert anonymous.status_code == 503 and body["reason"] == "a model is not served"
            assert str(tmp_path) not in anonymous.text, anonymous.text
            assert not {"models", "errors", "states"} & set(body), body
        detailed = c.get("/readyz", headers={"Authorization": "Bearer alpha"})
    with loaded() as c:
        untokened = c.get("/readyz")
    for r in (detailed, untokened):
        assert r.status_code == 503 and str(tmp_path) in r.json()["reason"], r.text
        assert {"models", "errors", "states"} <= set(r.json()), r.text


def test_metrics_can_be_protected(tmp_path):
    c = client(tmp_path, api_tokens="alpha", protect_metrics=True)
    assert c.get("/metrics").status_code == 401
    assert c.get("/metrics", headers={"Authorization": "Bearer alpha"}).status_code == 200
    assert c.get("/healthz").status_code == 200


def test_no_tokens_means_no_auth(tmp_path):
    assert client(tmp_path).get("/models").status_code == 200


def test_responses_carry_safe_headers(tmp_path):
    c = client(tmp_path)
    for r in (c.get("/healthz"), c.get("/nope"), c.delete("/models"), c.post("/decode/x")):
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["X-Frame-Options"] == "DENY"
        assert r.headers["Referrer-Policy"] == "no-referrer"
        assert r.headers["Cache-Control"] == "no-store"
        assert "default-src 'none'" in r.headers["Content-Security-Policy"]
        assert r.headers["content-type"].startswith("application/json")
    # Swagger UI's page has its own policy: its scripts and styles from the service only
    assert c.get("/docs").headers["Content-Security-Policy"] == DOCS_CSP


def test_user_input_never_becomes_a_log_format_string(tmp_path, caplog):
    hostile = "%s%d%(boom)s%n"
    with caplog.at_level("INFO"):
        client(tmp_path).post(
            "/decode/x%25s", params={"model": hostile}, headers={"User-Agent": hostile}
        )
    records = [r for r in caplog.records if r.name.startswith("app")]
    assert records
    for record in records:
        assert hostile not in str(record.msg)
        record.getMessage()  # formats: the input only ever travels as an argument


# --- the client address (X-Forwarded-For from trusted proxies only) ----------------------


@pytest.mark.parametrize("trusted, logged", [
    ("127.0.0.1", "203.0.113.7"),  # the test is the trusted proxy: its header names the client
    ("10.9.9.9", "127.0.0.1"),     # an untrusted peer's header is ignored: a client cannot forge it
])  # fmt: skip
def test_the_client_address_comes_from_x_forwarded_for_of_trusted_proxies_only(
    store, tmp_path, trusted, logged
):
    log = tmp_path / "serve.log"
    env = {**SERVE_FAULTY, "VAE_LOG_FORMAT": "json", "VAE_FORWARDED_ALLOW_IPS": trusted}
    with faulty.serve_process(store, log, True, **env) as (url, _):
        r = post(url, faulty.latent(tag=120), headers={"X-Forwarded-For": "203.0.113.7"})
        assert r.status_code == 200
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    (request,) = [e for e in lines if e.get("httpRequest", {}).get("status") == 200]
    assert request["httpRequest"]["remoteIp"] == logged, request
