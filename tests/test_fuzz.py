"""Hostile input, generated: the parser takes any bytes and any params to a value or a 4xx
``ProtocolError`` (never another exception, never a hang), and schemathesis drives the live
service from its own OpenAPI schema (never a 5xx). Sizes and example counts are bounded."""

from __future__ import annotations

import json
import math
import signal
import struct
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.protocol import (
    DECODE_PARAMS,
    DecodeParams,
    Limits,
    ModelGeometry,
    ProtocolError,
    parse_body,
    parse_params,
)
from app.protocol.output import choose_output
from app.protocol.shapes import check_limits, check_scaling, to_layout
from tests import faulty
from tests.live import live_server

FUZZ = settings(
    max_examples=300,
    deadline=None,  # the alarm below bounds each example instead (load here is shared)
    database=None,  # no .hypothesis/ folder in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
LIMITS = Limits(max_body_bytes=1 << 16, max_pixels=256 * 256, max_frames=33, max_batch=4)
GEOMETRIES = [
    ModelGeometry(4, 8, 1, False, lambda t: t),
    ModelGeometry(16, 8, 1, False, lambda t: t),
    ModelGeometry(4, 8, 4, True, lambda t: 1 + (t - 1) * 4),
]


@contextmanager
def no_hang(seconds: float = 5.0) -> Iterator[None]:
    """Fail an example that runs longer than ``seconds`` (SIGALRM: pytest's main thread)."""

    def alarm(signum, frame):
        raise TimeoutError(f"an example ran over {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def refused_or(fn, *args):
    """``fn(*args)``, or None when it refused with a 4xx ``ProtocolError``."""
    try:
        with no_hang():
            return fn(*args)
    except ProtocolError as exc:
        assert 400 <= exc.status < 500 and exc.body()["error"], exc.status
        return None


# --- params --------------------------------------------------------------------------------

TRICKY = [
    "True", "false", "1", "0", "yes", "", " ", "nan", "-inf", "1e400", "-0", "0x10", "1_000",
    "[1,16,8,8]", "[1, 4, 2, 2]", "1,4,2,2", "[[1]]", "[" * 3000, "[1e400]", "[true]", "[1.5]",
    "{}", "null", "9" * 5000, "\x00", "é", "%s%n", "../..", "mp4", "pt", "pil", "preview", "png", "jpeg",
]  # fmt: skip
values = st.one_of(
    st.sampled_from(TRICKY),
    st.text(max_size=40),
    st.from_regex(r"-?[0-9]{1,30}(\.[0-9]{1,10})?(e-?[0-9]{1,4})?", fullmatch=True),
)
keys = st.one_of(st.sampled_from(sorted(DECODE_PARAMS)), st.text(max_size=12))
items = st.lists(st.tuples(keys, values), max_size=12)


@FUZZ
@given(items)
def test_any_params_parse_or_are_refused_with_a_4xx(query):
    params = refused_or(parse_params, query)
    if params is not None:
        assert params.dtype in ("float32", "float16", "bfloat16")
        assert params.timeout is None or params.timeout > 0


@FUZZ
@given(items, st.sampled_from([None, "", "text/plain", "tensor/binary", "video/mp4, image/*"]))
def test_any_params_choose_an_output_or_are_refused(query, accept):
    params = refused_or(parse_params, query)
    if params is not None:
        refused_or(choose_output, params, accept, False)
        refused_or(choose_output, params, accept, True)


# --- bodies --------------------------------------------------------------------------------

CONTENT_TYPES = [
    None, "", "tensor/binary", "application/octet-stream", "application/x-safetensors",
    "application/x-npy", "APPLICATION/X-NPY; q=1", "image/png", "text/plain; charset=utf-8",
]  # fmt: skip
shapes = st.lists(st.integers(1, 6), min_size=2, max_size=5)
huge_shapes = st.lists(st.integers(0, 2**40), min_size=0, max_size=5)


def run_pipeline(content_type, body: bytes, params: DecodeParams, geo: ModelGeometry) -> None:
    """What the service does to a body before it queues it: parse, layout, limits."""
    tensor = refused_or(parse_body, content_type, body, params)
    if tensor is None:
        return
    latent = refused_or(to_layout, tensor, params, geo)
    if latent is not None:
        refused_or(check_limits, latent.float(), geo, LIMITS)
        refused_or(check_scaling, latent, params)


@st.composite
def raw_bodies(draw) -> tuple[bytes, DecodeParams]:
    """A raw tensor body that matches its shape (or is off by a few bytes), any floats."""
    shape, dtype = draw(shapes), draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    query = [("shape", json.dumps(shape)), ("dtype", dtype)]
    if draw(st.booleans()):
        query += [
            ("height", str(draw(st.integers(1, 64)))),
            ("width", str(draw(st.integers(1, 64)))),
        ]
    n = math.prod(shape) * (4 if dtype == "float32" else 2)
    body = draw(st.binary(min_size=n, max_size=n)) + b"\0" * draw(st.sampled_from([0, 0, 0, 2]))
    return body, parse_params(query)


@FUZZ
@given(raw_bodies(), st.sampled_from(GEOMETRIES))
def test_raw_bodies_of_any_content_become_a_latent_or_a_4xx(body_params, geo):
    body, params = body_params
    run_pipeline("tensor/binary", body, params, geo)


@FUZZ
@given(st.sampled_from(CONTENT_TYPES), st.binary(max_size=2048), items, st.sampled_from(GEOMETRIES))
def test_any_bytes_with_any_params_are_a_latent_or_a_4xx(content_type, body, query, geo):
    params = refused_or(parse_params, query)
    if params is not None:
        run_pipeline(content_type, body, params, geo)


@st.composite
def npy_bodies(draw) -> bytes:
    """A .npy header that may lie about its shape, dtype or size, then some data."""
    descr = draw(
        st.sampled_from(["<f4", "<f2", ">f4", "|u1", "<f8", "|O", "<c8", "[('a', '<f4')]"])
    )
    shape = tuple(draw(huge_shapes))
    header = f"{{'descr': {descr!r}, 'fortran_order': {draw(st.booleans())}, 'shape': {shape}, }}"
    if draw(st.integers(0, 9)) == 0:
        header = draw(st.text(max_size=60))  # not a dict at all
    version = draw(st.sampled_from([(1, 0), (2, 0), (3, 0), (9, 9)]))
    encoded = header.encode("utf-8", "replace")
    size = struct.pack("<H" if version[0] == 1 else "<I", len(encoded) + 1)
    data = draw(st.binary(max_size=256))
    return b"\x93NUMPY" + bytes(version) + size + encoded + b"\n" + data


@FUZZ
@given(npy_bodies(), st.sampled_from(GEOMETRIES))
def test_npy_headers_that_lie_are_refused_before_allocating(body, geo):
    run_pipeline("application/x-npy", body, DecodeParams(), geo)


def test_a_valid_npy_round_trips():
    import io

    array = np.arange(1 * 4 * 2 * 3, dtype=">f2").reshape(1, 4, 2, 3)
    buf = io.BytesIO()
    np.save(buf, np.asfortranarray(array))
    got = parse_body("application/x-npy", buf.getvalue(), DecodeParams())
    assert np.array_equal(got.numpy(), array.astype("<f2"))


@st.composite
def safetensors_bodies(draw) -> bytes:
    """A safetensors header with any dtypes, shapes and offsets, then some data."""
    tensors = {}
    for i in range(draw(st.integers(0, 3))):
        begin = draw(st.integers(0, 300))
        tensors[f"t{i}"] = {
            "dtype": draw(
                st.sampled_from(["F32", "F16", "BF16", "F64", "U8", "BOOL", "F8_E4M3", "X"])
            ),
            "shape": draw(huge_shapes),
            "data_offsets": [begin, begin + draw(st.integers(-4, 300))],
        }
    header = json.dumps(tensors).encode()
    if draw(st.integers(0, 9)) == 0:
        header = draw(st.binary(max_size=64))
    declared = draw(st.sampled_from([len(header), len(header), 2**63, 0, len(header) + 7]))
    return struct.pack("<Q", declared) + header + draw(st.binary(max_size=512))


@FUZZ
@given(safetensors_bodies(), st.sampled_from(GEOMETRIES))
def test_safetensors_headers_that_lie_are_refused(body, geo):
    run_pipeline("application/x-safetensors", body, DecodeParams(), geo)


# --- the live service, from its OpenAPI schema ---------------------------------------------


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    store = tmp_path_factory.mktemp("fuzz-store")
    with faulty.registered():
        faulty.bake(store, "faulty")
        with live_server(store, device="cpu", dtype="float32", default_model="faulty") as url:
            yield url, schemathesis.openapi.from_url(f"{url}/openapi.json")


LATENT = faulty.latent().numpy().tobytes()


@schemathesis.serializer("tensor/binary", "application/x-safetensors", "application/x-npy")
def _binary(ctx, value) -> bytes:
    """The service's binary body types go on the wire as bytes (or the value's JSON text)."""
    return value if isinstance(value, bytes) else json.dumps(value, default=str).encode()


OPERATIONS = ["GET /healthz", "GET /readyz", "GET /models", "GET /metrics"]
OPERATIONS += ["POST /decode/{model}", "POST /decode"]


def missed_deadline(response) -> bool:
    """The one 5xx the contract allows here: a generated X-Request-Timeout too short to meet
    is refused like overload, 503 with Retry-After and the reason."""
    body = response.json() if response.status_code == 503 else {}
    return "deadline" in body.get("error", "") and "retry-after" in {
        k.lower() for k in response.headers
    }


@pytest.mark.parametrize("operation", OPERATIONS)
def test_schemathesis_finds_no_server_error(api, operation):
    url, schema = api
    method, path = operation.split()
    op = next(
        r.ok()
        for r in schema.get_all_operations()
        if r.ok().path == path and r.ok().method == method.lower()
    )
    strategies = [op.as_strategy()]
    if op.method == "post":
        negative = schemathesis.GenerationMode.NEGATIVE  # out-of-schema params too
        valid = {"body": LATENT, "media_type": "tensor/binary", "query": {"shape": "[1,4,4,4]"}}
        if "{model}" in path:
            valid["path_parameters"] = {"model": "faulty"}
        strategies += [op.as_strategy(negative), op.as_strategy(**valid)]  # valid: decodes
    seen: dict[int, int] = {}
    session = requests.Session()

    @settings(FUZZ, max_examples=40 if op.method == "post" else 3)
    @given(st.one_of(*strategies))
    def call(case):
        response = case.call(base_url=url, session=session, timeout=30)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500 or missed_deadline(response), (
            case.path,
            case.query,
            response.text[:300],
        )
        if response.status_code >= 400:  # every refusal says what was wrong, as JSON
            assert response.headers["content-type"][0] == "application/json"
            assert response.json()["error"]

    call()
    print(operation, dict(sorted(seen.items())))


def test_every_body_format_is_read_in_place_and_round_trips():
    """A raw, C-order ``.npy`` or safetensors body is parsed into the body's own buffer (no
    copy the body budget would not count), values and shape as sent."""
    import io

    import torch
    from safetensors.torch import save

    tensor = torch.randn(1, 4, 6, 5).to(torch.bfloat16)
    buf = io.BytesIO()
    np.save(buf, torch.randn(1, 4, 6, 5).numpy())
    bodies = {
        "tensor/binary": (tensor.view(torch.int16).numpy().tobytes(), tensor),
        "application/x-npy": (
            buf.getvalue(),
            torch.from_numpy(np.load(io.BytesIO(buf.getvalue()))),
        ),
        "application/x-safetensors": (save({"z": tensor}, metadata={"by": "a sampler"}), tensor),
    }
    params = DecodeParams(shape=(1, 4, 6, 5), dtype="bfloat16")
    for content_type, (data, want) in bodies.items():
        body = bytearray(data)
        got = parse_body(content_type, body, params)
        assert torch.equal(got, want), content_type
        start = np.frombuffer(body, np.uint8).ctypes.data
        assert start <= got.data_ptr() < start + len(body), f"{content_type}: a copy"
