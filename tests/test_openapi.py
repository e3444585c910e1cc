"""``/openapi.json`` says what the service does, and ``/docs`` needs nothing from another origin.

* The description against the protocol's own tables, without a server: the documented query
  params are exactly the ones each route accepts, their bounds and enums are ``parse_params``'
  own, and every refusal body the service builds fits the error schemas.
* A live uvicorn server (tiny FLUX.1 decoder with its encoder, the same decoder alone, a tiny
  LTX video decoder) driven by schemathesis from its own ``/openapi.json``: every answer's
  status code, content type, body and headers must be declared (``status_code_conformance``,
  ``content_type_conformance``, ``response_schema_conformance``,
  ``response_headers_conformance``). Explicit cases ask for every kind of answer the routes
  have (each image format, tensors, the preview, a streamed MP4, each latent format, the
  refusals, 401s from a second server with tokens on); generated ones (positive and negative,
  few per operation, derandomized) probe the rest.
  Every header an answer carries beyond HTTP's own and the envelope's must be declared too.
* ``/docs``: Swagger UI from the package, its page and assets answering 200 with a CSP that
  names no other origin; in a headless Chromium (skipped without it) it renders every
  operation with no console error and no request to another origin.

Against the code before issue 36.10 (FastAPI's description, the CDN docs page) this fails.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import schemathesis
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.config import Settings
from app.families import family
from app.http import create_app
from app.protocol import DECODE_PARAMS, ENCODE_PARAMS, ProtocolError, parse_params
from app.store import write_model
from tests.live import bake, live_server

CHECKS = [
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
FLUX_TINY = {
    "latent_channels": 16,
    "block_out_channels": [16, 32, 32, 32],
    "layers_per_block": 1,
    "norm_num_groups": 8,
}
TOKEN = "openapi-test-token"
BODY_TYPES = (
    "tensor/binary", "application/octet-stream", "application/x-safetensors", "application/x-npy",
    "image/png", "image/jpeg", "image/jpg", "image/webp", "video/mp4",
)  # fmt: skip


@schemathesis.serializer(*BODY_TYPES)
def _binary(ctx, value) -> bytes:
    """The service's body types go on the wire as bytes (or the generated value's JSON text)."""
    return value if isinstance(value, bytes) else json.dumps(value, default=str).encode()


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> dict[str, Any]:
    """The schema as the app builds it (no models: it does not depend on them)."""
    app = create_app(Settings(models_dir=tmp_path_factory.mktemp("no-models")))
    return app.openapi()


def operation(spec: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    return spec["paths"][path][method]


def query_params(op: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in op["parameters"] if p["in"] == "query"}


# --- the description against the protocol ----------------------------------------------------


def test_each_route_documents_exactly_the_params_the_protocol_accepts(spec):
    for path, accepted in (
        ("/decode", DECODE_PARAMS),
        ("/decode/{model}", DECODE_PARAMS),
        ("/encode", ENCODE_PARAMS),
        ("/encode/{model}", ENCODE_PARAMS),
    ):
        op = operation(spec, "post", path)
        assert set(query_params(op)) == set(accepted), path
        headers = {p["name"] for p in op["parameters"] if p["in"] == "header"}
        expected = {"X-Request-Timeout", *(["X-Tensor-Layout"] if "decode" in path else [])}
        assert headers == expected, path
        assert ("{model}" in path) == any(p["in"] == "path" for p in op["parameters"])
    # FastAPI's own 422 model is gone: every refusal is the service's
    assert "HTTPValidationError" not in json.dumps(spec)


def _accepts(name: str, value: Any) -> bool:
    try:
        parse_params([(name, str(value))])
    except ProtocolError as exc:
        assert exc.status == 422
        return False
    return True


def test_documented_bounds_and_enums_are_the_parsers(spec):
    checked = 0
    for path in ("/decode", "/encode"):
        for name, param in query_params(operation(spec, "post", path)).items():
            schema = param["schema"]
            if name in ("sample", "packed"):  # encode's own: parse_encode_head reads them
                continue
            if "enum" in schema:
                assert all(_accepts(name, v) for v in schema["enum"]), name
                assert not _accepts(name, "no-such-value"), name
                checked += 1
            step = 1 if schema.get("type") == "integer" else 1e-6
            if "minimum" in schema:
                assert _accepts(name, schema["minimum"]), name
                assert not _accepts(name, schema["minimum"] - step), name
                checked += 1
            if "maximum" in schema:
                assert _accepts(name, schema["maximum"]), name
                assert not _accepts(name, schema["maximum"] + step), name
                checked += 1
            if "exclusiveMinimum" in schema:
                assert not _accepts(name, schema["exclusiveMinimum"]), name
                assert _accepts(name, schema["exclusiveMinimum"] + step), name
                checked += 1
    shape = query_params(operation(spec, "post", "/decode"))["shape"]["schema"]
    dims = shape["items"]
    assert _accepts("shape", json.dumps([dims["maximum"]] * shape["minItems"]))
    assert not _accepts("shape", json.dumps([1] * (shape["minItems"] - 1)))
    assert not _accepts("shape", json.dumps([1] * (shape["maxItems"] + 1)))
    assert not _accepts("shape", json.dumps([1, dims["minimum"] - 1]))
    assert checked >= 12


def test_an_undescribed_param_or_route_stops_the_description():
    from app.http import openapi

    with pytest.raises(RuntimeError, match="does not describe"):
        openapi.query_params(frozenset({*DECODE_PARAMS, "brand_new"}), "decode")
    app = create_app(Settings(models_dir=Path("/nonexistent")))

    @app.get("/undescribed")
    async def undescribed() -> dict[str, str]:
        return {}

    with pytest.raises(RuntimeError, match="GET /undescribed"):
        app.openapi()


def _validator(spec: dict[str, Any], schema: str):
    import jsonschema_rs

    root = {"$ref": f"#/components/schemas/{schema}", "components": spec["components"]}
    return jsonschema_rs.validator_for(root)


def test_every_refusal_body_fits_the_error_schema(spec):
    from app.http.auth import _refusal
    from app.http.errors import deadline_error, runtime_error
    from app.http.timeouts import MALFORMED_BODY, TIMEOUT_RESPONSE, shutdown_response
    from app.runtime.runner import InvalidInput, NonFiniteOutput, OutOfMemory, TooLarge
    from app.runtime.scheduler import DeadlineExceeded, DeviceLost, QueueFull, Stopped

    errors = _validator(spec, "Error")
    bodies = [
        runtime_error(exc, "m").body()
        for exc in (
            QueueFull("full"),
            DeadlineExceeded(1.0),
            Stopped(),
            DeviceLost("gone"),
            InvalidInput("no"),
            NonFiniteOutput("nan"),
            OutOfMemory("oom"),
            TooLarge("big"),
            RuntimeError("bug"),
        )
    ]
    bodies += [deadline_error(0.5, "encoder").body(), ProtocolError(422, "bad").body()]
    bodies += [json.loads(_refusal(t).body) for t in (None, b"wrong")]
    bodies += [json.loads(MALFORMED_BODY)]
    for raw in (TIMEOUT_RESPONSE, shutdown_response(1)):
        bodies.append(json.loads(raw.split(b"\r\n\r\n", 1)[1]))
    for body in bodies:
        assert errors.is_valid(body), body
    assert not errors.is_valid({"error": "x", "unexpected": 1})
    server = _validator(spec, "ServerError")
    assert server.is_valid({"error": "internal server error", "request_id": "abc"})
    assert server.is_valid({"error": "internal server error"})


def test_fastapis_own_validation_error_fits_its_schema(spec, tmp_path):
    """The one path that answers FastAPI's RequestValidationError rewritten: a typed query
    param on a route added for the test (the service's own routes have none to refuse)."""
    app = create_app(Settings(models_dir=tmp_path))

    @app.get("/typed")
    async def typed(n: int) -> dict[str, int]:
        return {"n": n}

    r = TestClient(app).get("/typed", params={"n": "x"})
    assert r.status_code == 422
    assert _validator(spec, "InvalidRequest").is_valid(r.json()), r.json()


# --- the live service, from its own schema ---------------------------------------------------


def _store(root: Path) -> Path:
    from app.families.ltx.decoder.synthetic import SYNTHETIC as LTX

    store = root / "store"
    store.mkdir()
    flux = family("flux")
    decoder = flux.decoder.module(FLUX_TINY)
    flux.decoder.init_synthetic(decoder, torch.Generator().manual_seed(0))
    encoder = flux.encoder.module(FLUX_TINY)
    flux.encoder.init_synthetic(encoder, torch.Generator().manual_seed(1))
    state = decoder.state_dict()
    write_model(store, "flux-enc", "flux", FLUX_TINY, state, source="test", dtype="float32",
                encoder_state=encoder.state_dict(), encoder_config=FLUX_TINY)  # fmt: skip
    write_model(store, "flux-dec", "flux", FLUX_TINY, state, source="test", dtype="float32")
    bake(store, "ltx", "ltx-tiny", LTX["ltx-tiny"])
    return store


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[tuple[str, Any]]:
    root = tmp_path_factory.mktemp("openapi")
    serve = {"device": "cpu", "dtype": "float32"}
    with live_server(_store(root), default_model="flux-enc", **serve) as url:
        assert requests.get(f"{url}/readyz", timeout=10).status_code == 200
        yield url, schemathesis.openapi.from_url(f"{url}/openapi.json")


@pytest.fixture(scope="module")
def guarded(tmp_path_factory) -> Iterator[str]:
    """A second server with tokens on (metrics protected too) and nothing to serve."""
    store = tmp_path_factory.mktemp("guarded")
    with live_server(store, api_tokens=TOKEN, protect_metrics=True) as url:
        yield url


def _op(schema, method: str, path: str):
    return schema[path][method.upper()]


def _raw(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def _npy(t: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, t.numpy())
    return buffer.getvalue()


def _safetensors(t: torch.Tensor) -> bytes:
    from safetensors.torch import save

    return save({"t": t.contiguous()})


def _image(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 40, 90)).save(buffer, fmt)
    return buffer.getvalue()


LATENT = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
VIDEO = torch.randn(1, 128, 2, 1, 1, generator=torch.Generator().manual_seed(0))
PIXELS = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
RAW = {"shape": json.dumps(list(LATENT.shape)), "dtype": "float32"}
RAW_VIDEO = {"shape": json.dumps(list(VIDEO.shape))}
RAW_PIXELS = {"shape": json.dumps(list(PIXELS.shape))}
TENSOR = "tensor/binary"

# (label, method, path, path params, query, headers, body, media type, status, content type)
CASES: list[tuple] = [
    ("png", "post", "/decode/{model}", {"model": "flux-enc"}, RAW, {}, _raw(LATENT), TENSOR,
     200, "image/png"),
    ("jpeg", "post", "/decode/{model}", {"model": "flux-enc"}, {**RAW, "image_format": "jpg"},
     {}, _raw(LATENT), TENSOR, 200, "image/jpeg"),
    ("webp by Accept", "post", "/decode/{model}", {"model": "flux-dec"}, RAW,
     {"Accept": "image/webp"}, _raw(LATENT), TENSOR, 200, "image/webp"),
    ("pt", "post", "/decode/{model}", {"model": "flux-enc"}, {**RAW, "output_type": "pt"}, {},
     _raw(LATENT), TENSOR, 200, TENSOR),
    ("uint8", "post", "/decode/{model}", {"model": "flux-enc"},
     {**RAW, "output_type": "pt", "partial_postprocess": "true"}, {}, _raw(LATENT), TENSOR,
     200, TENSOR),
    ("unit tensor by Accept", "post", "/decode", {}, RAW, {"Accept": TENSOR}, _raw(LATENT),
     TENSOR, 200, TENSOR),
    ("preview", "post", "/decode", {}, {**RAW, "output_type": "preview"}, {}, _raw(LATENT),
     TENSOR, 200, "image/png"),
    ("safetensors", "post", "/decode", {}, {"model": "flux-dec"}, {}, _safetensors(LATENT),
     "application/x-safetensors", 200, "image/png"),
    ("npy", "post", "/decode/{model}", {"model": "flux-enc"}, {"output_type": "pt"}, {},
     _npy(LATENT), "application/x-npy", 200, TENSOR),
    ("mp4", "post", "/decode/{model}", {"model": "ltx-tiny"},
     {**RAW_VIDEO, "output_type": "mp4"}, {}, _raw(VIDEO), TENSOR, 200, "video/mp4"),
    ("video frames", "post", "/decode", {}, {**RAW_VIDEO, "model": "ltx-tiny"}, {},
     _raw(VIDEO), TENSOR, 200, TENSOR),
    ("wrong byte count", "post", "/decode", {}, RAW, {}, _raw(LATENT)[:-4], TENSOR, 400,
     "application/json"),
    ("no such model", "post", "/decode/{model}", {"model": "nope"}, RAW, {}, _raw(LATENT),
     TENSOR, 404, "application/json"),
    ("over the pixel limit", "post", "/decode", {}, {"shape": "[1,16,4096,4096]"}, {},
     _raw(LATENT), TENSOR, 413, "application/json"),
    ("compressed", "post", "/decode", {}, RAW, {"Content-Encoding": "gzip"}, _raw(LATENT),
     TENSOR, 415, "application/json"),
    ("unknown param", "post", "/decode", {}, {**RAW, "image_fromat": "png"}, {}, _raw(LATENT),
     TENSOR, 422, "application/json"),
    ("deadline", "post", "/decode", {}, RAW, {"X-Request-Timeout": "0.000001"}, _raw(LATENT),
     TENSOR, 503, "application/json"),
    ("encode png", "post", "/encode/{model}", {"model": "flux-enc"}, {}, {}, _image("PNG"),
     "image/png", 200, TENSOR),
    ("encode jpeg to safetensors", "post", "/encode", {}, {},
     {"Accept": "application/x-safetensors"}, _image("JPEG"), "image/jpeg", 200,
     "application/x-safetensors"),
    ("encode pixels to npy", "post", "/encode", {}, {**RAW_PIXELS, "sample": "true", "seed": "3"},
     {"Accept": "application/x-npy"}, _raw(PIXELS), TENSOR, 200, "application/x-npy"),
    ("encode a decoder-only entry", "post", "/encode/{model}", {"model": "flux-dec"}, {}, {},
     _image("PNG"), "image/png", 404, "application/json"),
    ("mp4 to an image model", "post", "/encode", {}, {}, {}, b"\0\0\0\x18ftypmp42", "video/mp4",
     415, "application/json"),
    ("seed without sample", "post", "/encode", {}, {"seed": "1"}, {}, _image("PNG"),
     "image/png", 422, "application/json"),
    ("health", "get", "/healthz", {}, {}, {}, None, None, 200, "application/json"),
    ("ready", "get", "/readyz", {}, {}, {}, None, None, 200, "application/json"),
    ("models", "get", "/models", {}, {}, {}, None, None, 200, "application/json"),
    ("metrics", "get", "/metrics", {}, {}, {}, None, None, 200, "text/plain"),
    ("page", "get", "/", {}, {}, {}, None, None, 200, "text/html"),
]  # fmt: skip
# against the server with tokens on: (label, method, path, path params, headers, status)
GUARDED: list[tuple] = [
    ("no token", "post", "/decode/{model}", {"model": "x"}, {}, 401),
    ("unknown token", "post", "/encode", {}, {"Authorization": "Bearer nope"}, 401),
    ("models without a token", "get", "/models", {}, {}, 401),
    ("protected metrics", "get", "/metrics", {}, {}, 401),
    ("not ready", "get", "/readyz", {}, {}, 503),
    ("health stays open", "get", "/healthz", {}, {}, 200),
    ("page stays open", "get", "/", {}, {}, 200),
    ("no such model, with the token", "post", "/decode/{model}", {"model": "x"},
     {"Authorization": f"Bearer {TOKEN}"}, 404),
]  # fmt: skip


# headers every answer may carry that say nothing about the operation: HTTP's own and the
# envelope's safe defaults (app/http/envelope.py)
GENERIC_HEADERS = {
    "date", "server", "content-length", "content-type", "transfer-encoding", "connection",
    "content-security-policy", "x-content-type-options", "cache-control", "referrer-policy",
    "x-frame-options",
}  # fmt: skip


def declares_every_header(ctx, response, case) -> None:
    """Every header an answer carries beyond ``GENERIC_HEADERS`` is declared for its status
    (schemathesis checks the declared ones; this catches a new one nobody described)."""
    declared = case.operation.responses.find_by_status_code(response.status_code)
    names = {name.lower() for name, _ in (declared.headers.items() if declared else ())}
    sent = {name.lower() for name in response.headers} - GENERIC_HEADERS
    assert sent <= names, f"{case.operation.label} {response.status_code}: {sent - names}"


CHECKS.append(declares_every_header)


def _media(response: Any) -> str:
    """A requests or a schemathesis response's media type (the latter's headers are lists)."""
    value = response.headers.get("content-type") or ""
    value = value[0] if isinstance(value, list) else value
    return value.split(";")[0].strip()


def test_every_kind_of_answer_is_declared(live):
    url, schema = live
    seen = []
    for label, method, path, path_params, query, headers, body, media, status, kind in CASES:
        fields: dict[str, Any] = {"path_parameters": path_params, "query": query}
        fields["headers"] = headers
        if body is not None:
            fields.update(body=body, media_type=media)
        case = _op(schema, method, path).Case(**fields)
        # no session: with one, schemathesis 4.32.5 sent the session's Accept, not the case's
        response = case.call(base_url=url, timeout=60)
        assert (response.status_code, _media(response)) == (status, kind), (
            label,
            response.content[:300],
        )
        case.validate_response(response, checks=CHECKS)
        seen.append(label)
    assert len(seen) == len(CASES)


def test_refusals_with_tokens_on_are_declared(live, guarded):
    _, schema = live  # the same description: it does not depend on the settings
    for label, method, path, path_params, headers, status in GUARDED:
        fields: dict[str, Any] = {"path_parameters": path_params, "headers": headers}
        if method == "post":
            fields.update(body=_raw(LATENT), media_type=TENSOR, query=RAW)
        case = _op(schema, method, path).Case(**fields)
        response = case.call(base_url=guarded, timeout=30)
        assert response.status_code == status, (label, response.content[:300])
        case.validate_response(response, checks=CHECKS)


GENERATED = settings(
    derandomize=True,  # the same examples every run
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
OPERATIONS = [
    ("get", "/healthz"), ("get", "/readyz"), ("get", "/models"), ("get", "/metrics"),
    ("get", "/"), ("post", "/decode/{model}"), ("post", "/decode"),
    ("post", "/encode/{model}"), ("post", "/encode"),
]  # fmt: skip
VALID = {  # a generated case with a body the route reads
    "/decode": {"body": _raw(LATENT), "media_type": TENSOR, "query": {"shape": [1, 16, 4, 4]}},
    "/encode": {"body": _image("PNG"), "media_type": "image/png"},
}


@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_generated_requests_get_declared_answers(live, method, path):
    url, schema = live
    op = _op(schema, method, path)
    strategies = [op.as_strategy()]
    if method == "post":
        route = path.removesuffix("/{model}")
        valid = dict(VALID[route])
        if "{model}" in path:
            valid["path_parameters"] = {"model": "flux-enc"}
        strategies += [
            op.as_strategy(schemathesis.GenerationMode.NEGATIVE),
            op.as_strategy(**valid),
        ]
    session = requests.Session()
    seen: dict[int, int] = {}

    @settings(GENERATED, max_examples=50 if method == "post" else 2)
    @given(st.one_of(*strategies))
    def call(case):
        response = case.call(base_url=url, session=session, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code != 500, response.content[:300]
        case.validate_response(response, checks=CHECKS)

    call()
    print(method, path, dict(sorted(seen.items())))


# --- the docs page -----------------------------------------------------------------------------


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.refs += [v for k, v in attrs if k in ("src", "href") and v]


def test_docs_load_nothing_from_another_origin(live):
    url, _ = live
    page = requests.get(f"{url}/docs", timeout=10)
    assert page.status_code == 200 and _media(page) == "text/html"
    parser = _Refs()
    parser.feed(page.text)
    fetched = [r for r in parser.refs if r != "data:,"]  # the icon: none, so no /favicon.ico
    assert fetched and all(r.startswith("/") and not r.startswith("//") for r in fetched)
    assert not re.search(r"https?:|//[a-z]", page.text), page.text
    assert "<script>" not in page.text and "<style" not in page.text  # nothing inline
    csp = page.headers["Content-Security-Policy"]
    sources = {s for directive in csp.split(";") for s in directive.split()[1:]}
    assert sources <= {"'self'", "'none'", "data:", "blob:"}, csp
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    kinds = {".js": "text/javascript", ".css": "text/css"}
    for ref in fetched:
        asset = requests.get(url + ref, timeout=10)
        assert asset.status_code == 200, ref
        assert _media(asset) == kinds[Path(ref).suffix], ref
        assert asset.headers["Content-Security-Policy"] == csp
    init = requests.get(f"{url}/docs/init.js", timeout=10).text
    assert '"/openapi.json"' in init and "validatorUrl: null" in init
    assert not re.search(r"https?:", init)
    for gone in ("/redoc", "/docs/oauth2-redirect"):  # FastAPI's CDN pages are not served
        assert requests.get(url + gone, timeout=10).status_code == 404, gone


def test_docs_assets_are_the_packaged_swagger_ui(live):
    from importlib.resources import files

    url, _ = live
    bundle = requests.get(f"{url}/docs/swagger-ui-bundle.js", timeout=10).content
    packaged = (files("fastapi_offline") / "static" / "swagger-ui-bundle.js").read_bytes()
    assert bundle == packaged and b"SwaggerUIBundle" in bundle


CHROMIUM = Path("/usr/bin/chromium")


def test_docs_render_offline_in_a_browser(live):
    """Swagger UI renders every operation in a headless Chromium under the page's CSP, with no
    console error (a CSP violation is one) and no request to another origin. Needs Debian's
    chromium and playwright (scripts/install_ci_deps.sh): skips without."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: run `bash scripts/install_ci_deps.sh`")
    sync_api = pytest.importorskip("playwright.sync_api")
    url, schema = live
    operations = sum(1 for item in schema.raw_schema["paths"].values() for _ in item)
    flags = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync"]  # fmt: skip
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=flags)
        try:
            page = browser.new_page()
            problems: list[str] = []
            origins: set[str] = set()
            page.on("console", lambda m: m.type == "error" and problems.append(m.text))
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("request", lambda r: origins.add(r.url.split("/")[2]))
            page.goto(f"{url}/docs")
            page.wait_for_selector(".opblock", timeout=60_000)
            assert page.locator(".opblock").count() == operations
            assert not page.locator(".errors-wrapper").count()  # Swagger UI read the schema
        finally:
            browser.close()
    assert not problems, problems
    assert origins == {url.split("/")[2]}, origins
