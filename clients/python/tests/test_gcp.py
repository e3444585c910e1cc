"""vae_client.gcp.id_token_provider with the real google-auth: a service account key whose
token endpoint is a local stand-in for Google's, then a live server that accepts that ID token.
Skips when google-auth (the [gcp] extra) is absent."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import pytest

pytest.importorskip("google.auth", reason="the [gcp] extra (google-auth) is not installed")
pytest.importorskip("requests", reason="google-auth's requests transport needs requests")
rsa = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.rsa")
serialization = pytest.importorskip("cryptography.hazmat.primitives.serialization")

from vae_client import Client, jwt_expiry  # noqa: E402
from vae_client.gcp import id_token_provider  # noqa: E402


def _b64(obj: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()


EXPIRES = int(time.time()) + 3600
ID_TOKEN = f"{_b64({'alg': 'RS256', 'typ': 'JWT'})}.{_b64({'exp': EXPIRES, 'iat': 0})}.c2ln"


class _TokenEndpoint(BaseHTTPRequestHandler):
    grants: list[dict[str, str]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        self.grants.append(dict(urllib.parse.parse_qsl(body)))
        answer = json.dumps({"id_token": ID_TOKEN}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def service_account(tmp_path, monkeypatch):
    endpoint = HTTPServer(("127.0.0.1", 0), _TokenEndpoint)
    threading.Thread(target=endpoint.serve_forever, daemon=True).start()
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()  # fmt: skip
    info = {"type": "service_account", "project_id": "p", "private_key_id": "k1",
            "private_key": pem, "client_email": "sampler@p.iam.gserviceaccount.com",
            "client_id": "1", "token_uri": f"http://127.0.0.1:{endpoint.server_port}/token"}  # fmt: skip
    path = tmp_path / "key.json"
    path.write_text(json.dumps(info))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
    _TokenEndpoint.grants.clear()
    yield _TokenEndpoint.grants
    endpoint.shutdown()


def test_id_token_for_the_service_url_reaches_a_private_service(service_account, flux_store):
    import tests.live as live

    with live.live_server(flux_store, dtype="float32", default_model="flux-tiny",
                          api_tokens=ID_TOKEN) as url:  # fmt: skip
        provider = id_token_provider(url + "/")
        with Client(url, token=provider) as client:
            latent = np.zeros((1, 16, 4, 4), np.float32)
            assert client.decode(latent)[:4] == b"\x89PNG"
            assert client.decode(latent)[:4] == b"\x89PNG"
    # one grant (the token is cached until an hour minus the margin), for the service's URL
    (grant,) = service_account
    assert grant["grant_type"] == "urn:ietf:params:oauth:grant-type:jwt-bearer"
    claims = json.loads(base64.urlsafe_b64decode(grant["assertion"].split(".")[1] + "=="))
    assert claims["target_audience"] == url
    assert jwt_expiry(ID_TOKEN) == EXPIRES
