"""Hostile clients, round two (issue 15, points 3 and 5-9): what a black-box attack found.

Each test sends what the attack sent (scaled down to tiny models and tight caps) to a real
uvicorn server on loopback, or a raw socket where the client must misbehave.
"""

from __future__ import annotations

import gzip
import json
import re
import socket
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import requests
import torch

from app.protocol import Limits, ModelGeometry, ProtocolError, parse_params
from app.protocol.request import Output
from app.store import StoreError, check_name, write_model
from tests import faulty
from tests.helpers import upload_and_read
from tests.live import TINY_FLUX, bake, live_server


def flux_tiny_work(side: int, tiled: bool = False) -> int:
    """What the CPU plans for flux-tiny decoding a [1,16,side,side] latent in float32 (its
    own estimate times its ``cpu_margin``; ``tiled``: in row bands)."""
    from app.families import family

    decoder = family("flux").decoder.module(TINY_FLUX["flux-tiny"])
    return decoder.planned_bytes((1, 16, side, side), 4, tiled)


# tiny caps, so tiny requests cross them: a 1 MiB response; the decoder memory of a 128x128
# flux-tiny decode (whatever the family estimates it to be)
CAPS = {"max_output_mb": 1, "max_decode_mb": -(-flux_tiny_work(16) // (1 << 20))}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("hostile-store")
    bake(store, "flux", "flux-tiny", TINY_FLUX["flux-tiny"])
    with faulty.registered():
        faulty.bake(store, "faulty-video", video=True)
    # imported from a host path: /models must not show it
    from app.families import family

    decoder = family("flux").decoder.module(TINY_FLUX["flux-tiny"])
    state = decoder.state_dict()
    write_model(store, "imported", "flux", TINY_FLUX["flux-tiny"], state, "/srv/secret/ae-dir")
    return store


@pytest.fixture(scope="module")
def server(store):
    with faulty.registered():
        with live_server(store, device="cpu", dtype="float32", **CAPS) as url:
            yield url


def decode(url, shape, model="flux-tiny", body=None, headers=None, **params):
    z = torch.randn(*shape) if body is None else None
    return requests.post(
        f"{url}/decode/{model}",
        data=z.numpy().tobytes() if body is None else body,
        params={"shape": json.dumps(list(shape)), **params},
        headers={"Content-Type": "tensor/binary", **(headers or {})},
        timeout=60,
    )


def raw_exchange(url: str, request: bytes, wait_s: float) -> bytes:
    """Send ``request`` (headers only) on a raw socket; what comes back within ``wait_s``."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(request)
        try:
            return s.recv(65536)
        except TimeoutError:
            return b""


# --- 3. output size and decoder memory are bounded ----------------------------------------


def test_a_response_larger_than_the_output_cap_is_refused_with_the_numbers(server):
    r = decode(server, [1, 16, 48, 48], output_type="pt")  # 384x384 float32 = 1.7 MiB
    assert r.status_code == 413, r.text[:300]
    error = r.json()["error"]
    assert "1.7 MiB" in error and "1.0 MiB" in error and "384x384" in error, error
    assert decode(server, [1, 16, 16, 16], output_type="pt").status_code == 200  # 0.2 MiB


def test_a_decode_over_the_memory_cap_is_decoded_tiled_else_refused(server):
    """The 413 follows the decoder's own estimate (on the CPU times its ``cpu_margin``): the
    largest square latent within the cap decodes whole; past it a family that tiles is decoded
    tiled (FLUX's row bands) while the tiled plan fits, and the next size up is refused,
    naming the tiled plan."""
    cap = CAPS["max_decode_mb"] << 20
    whole = max(s for s in range(1, 73) if flux_tiny_work(s) <= cap)  # 72: the 1 MiB PNG cap
    tiled = max(s for s in range(1, 73) if flux_tiny_work(s, tiled=True) <= cap)
    assert whole < tiled < 72, "the caps do not separate the whole, tiled and refused sizes"
    for side in (whole, whole + 1, tiled):
        r = decode(server, [1, 16, side, side], image_format="png")
        assert r.status_code == 200, (side, r.text[:300])
    r = decode(server, [1, 16, tiled + 1, tiled + 1], image_format="png")
    assert r.status_code == 413, r.text[:300]
    error = r.json()["error"]
    assert "working memory even tiled" in error and f"{CAPS['max_decode_mb']:.1f} MiB" in error
    assert "VAE_MAX_DECODE_MB" in r.json()["expected"]  # the operator's setting that lifts it
    assert f"{flux_tiny_work(tiled + 1, tiled=True) / (1 << 20):.1f} MiB" in error


def test_hunyuan_video_clips_at_its_native_sizes_are_admitted_for_a_tiled_encode():
    """The encoder plans 16.5 and 29 GiB whole in bf16 at 61x544x960 and 129x720x1280, over
    the default cap: admitted on its tiled plan (the runner encodes them tiled); a cap under
    the tiled plan refuses them, naming it."""
    from app.families import family as described
    from app.protocol.encode import EncoderGeometry, _check_size

    with torch.device("meta"):
        encoder = described("hunyuan-video").encoder.module({}).to(torch.bfloat16)
    geo, limits = EncoderGeometry.of(encoder), Limits()
    for frames, h, w in ((61, 544, 960), (129, 720, 1280)):
        assert geo.planned_bytes((1, 3, frames, h, w)) > limits.max_decode_bytes
        _check_size(1, frames, h, w, geo, limits)
    small = replace(limits, max_decode_bytes=geo.tiled_planned_bytes((1, 3, 129, 720, 1280)) - 1)
    with pytest.raises(ProtocolError, match="even tiled"):
        _check_size(1, 129, 720, 1280, geo, small)


def test_hunyuan_video_at_its_native_sizes_is_admitted_tiled_by_the_default_caps():
    """HunyuanVideo 61x544x960 and 129x720x1280 plan 27 and 48 GiB whole on a GPU, over the
    default 16 GiB ``VAE_MAX_DECODE_MB``: admitted, since the runner decodes them tiled (a few
    GiB), as diffusers' pipelines do at these sizes; a cap under the tiled plan refuses them."""
    from app.protocol.shapes import check_declared
    from scripts.video_proof import HUNYUAN_VIDEO

    geo, limits = meta_geometry("hunyuan-video", HUNYUAN_VIDEO, torch.bfloat16), Limits()
    for shape in ("[1,16,16,68,120]", "[1,16,33,90,160]"):
        latent = parse_params([("shape", shape)])
        assert geo.planned_bytes(tuple(json.loads(shape))) > limits.max_decode_bytes
        check_declared(latent, "tensor/binary", geo, limits, Output.MP4)
    small = replace(limits, max_decode_bytes=geo.tiled_planned_bytes((1, 16, 33, 90, 160)) - 1)
    with pytest.raises(ProtocolError, match="even tiled"):
        check_declared(latent, "tensor/binary", geo, small, Output.MP4)


def meta_geometry(family: str, config: dict, dtype: torch.dtype = torch.float32) -> ModelGeometry:
    """A full-size decoder's geometry and memory estimate, built on the meta device (its
    config, not its weights), which plans as a GPU does (``gpu_margin``)."""
    from app.families import family as described

    with torch.device("meta"):
        decoder = described(family).decoder.module(config).to(dtype)
    return ModelGeometry.of(decoder)


def test_the_default_caps_refuse_the_attacks_ltx_request_and_keep_ordinary_ones():
    """[1,128,17,32,32] -> 129 frames of 1024x1024 as float32: 1.62 GB; refused from the
    query, with the server's defaults. A 121-frame 768x512 video still decodes."""
    from app.families.ltx.decoder.model import DEFAULTS
    from app.protocol.shapes import check_declared

    geo, limits = meta_geometry("ltx", DEFAULTS), Limits()
    attack = parse_params([("shape", "[1,128,17,32,32]"), ("output_type", "pt")])
    with pytest.raises(ProtocolError) as refused:
        check_declared(attack, "tensor/binary", geo, limits, Output.TENSOR)
    assert refused.value.status == 413 and "1548.0 MiB" in refused.value.error
    for kind in (Output.TENSOR, Output.MP4, Output.UNIT_TENSOR):
        ordinary = parse_params([("shape", "[1,128,16,16,24]")])  # 121 frames of 768x512
        check_declared(ordinary, "tensor/binary", geo, limits, kind)
    largest = parse_params([("shape", "[1,128,33,64,64]")])  # 257 frames of 2048x2048
    with pytest.raises(ProtocolError, match="the response would be 12336.0 MiB"):
        check_declared(largest, "tensor/binary", geo, limits, Output.UNIT_TENSOR)
    # streamed, the response is not held: only the decoder's own estimate can refuse it
    work = geo.planned_bytes((1, 128, 33, 64, 64))
    if work <= limits.max_decode_bytes:
        check_declared(largest, "tensor/binary", geo, limits, Output.MP4)
    else:
        with pytest.raises(ProtocolError, match="working memory"):
            check_declared(largest, "tensor/binary", geo, limits, Output.MP4)


def test_the_default_decoder_memory_cap_admits_one_2048_flux_image_not_three():
    from app.families.flux.decoder.model import FLUX1_CONFIG
    from app.protocol.shapes import check_declared

    geo, limits = meta_geometry("flux", FLUX1_CONFIG, torch.bfloat16), Limits()  # as on a GPU
    one = parse_params([("shape", "[1,16,256,256]")])
    check_declared(one, "tensor/binary", geo, limits, Output.IMAGE)  # ~8 GiB, as measured
    three = parse_params([("shape", "[3,16,256,256]"), ("output_type", "pt")])
    with pytest.raises(ProtocolError, match="working memory"):
        check_declared(three, "tensor/binary", geo, limits, Output.UINT8)


# --- 8. what the query already refuses is refused before the body is read -------------------


@pytest.mark.parametrize(
    "query",
    [
        "shape=[1,16,512,512]",  # 4096x4096: the pixel limit
        "shape=[1,16,128,128]&output_type=pt",  # 1024x1024 float32: the output cap
    ],
)
def test_a_shape_the_limits_refuse_is_answered_before_the_body_is_sent(server, query):
    shape = json.loads(query.split("=")[1].split("&")[0])
    length = int(np.prod(shape)) * 4
    request = (
        f"POST /decode/flux-tiny?{query} HTTP/1.1\r\nHost: x\r\n"
        f"Content-Type: tensor/binary\r\nContent-Length: {length}\r\n\r\n"
    ).encode()
    answer = raw_exchange(server, request, wait_s=10)  # no body byte is ever sent
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


# --- 5. non-finite output is an error, not pixels -------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        {"scaling_factor": "1e-50"},  # 0 in float32
        {"scaling_factor": "1e39"},  # inf in float32: every pixel would decode from 0
        {"shift_factor": "1e39"},  # inf in float32
    ],
)
def test_factors_are_checked_in_float32(server, params):
    zeros = bytes(16 * 4 * 4 * 4)  # 0 / 0 in float32 is NaN: the latent's peak cannot tell
    r = decode(server, [1, 16, 4, 4], body=zeros, output_type="pt", **params)
    assert r.status_code == 422 and "float32" in r.json()["error"], r.text[:300]


@pytest.mark.parametrize("output_type", ["pt", "pil"])
def test_a_decode_whose_output_is_not_finite_is_a_422(server, output_type):
    huge = (torch.ones(1, 16, 4, 4) * 1e30).numpy().tobytes()
    for r in (
        decode(server, [1, 16, 4, 4], output_type=output_type, shift_factor="1e20"),
        decode(server, [1, 16, 4, 4], body=huge, output_type=output_type),
    ):
        assert r.status_code == 422, (r.status_code, r.headers.get("content-type"))
        assert "not finite" in r.json()["error"]


# --- 6. .npy headers with impossible shapes -------------------------------------------------


def npy(shape_text: str, data: bytes) -> bytes:
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_text}, }}".encode()
    header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data


@pytest.mark.parametrize("shape", ["(-1, -256)", "(18446744073709551616, 0)", "(1, -4, -4)"])
def test_npy_headers_with_negative_or_huge_dims_are_a_400(server, shape):
    r = requests.post(
        f"{server}/decode/flux-tiny",
        data=npy(shape, b"\0" * 1024),
        headers={"Content-Type": "application/x-npy"},
        timeout=30,
    )
    assert r.status_code == 400 and "shape" in r.json()["error"], r.text[:300]


# --- 7. log injection -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["flux-tiny\n", "flux-tiny\r\n", "a\nb"])
def test_model_names_match_whole(name):
    with pytest.raises(StoreError):
        check_name(name)


def test_control_characters_never_reach_the_text_log_raw(store, tmp_path):
    forged = "2026-01-01 00:00:00,000 ERROR app.service: forged"
    path = f"/decode/flux-tiny%0d%0a{forged.replace(' ', '%20')}%00x"
    log = tmp_path / "serve.log"
    env = {"VAE_MODELS": "flux-tiny", "VAE_LOG_FORMAT": "text"}
    with faulty.serve_process(store, log, **env) as (url, _):
        r = requests.post(url + path + "?shape=[1,16,2,2]", data=b"\0" * 256, timeout=30)
        assert r.status_code == 404
        nul = requests.post(f"{url}/decode/flux-tiny?model=%00&shape=[1,16,2,2]", timeout=30)
        assert nul.status_code in (400, 404, 422)
        time.sleep(0.3)  # the request log line is written
    data = log.read_bytes()
    assert b"\x00" not in data and b"\r" not in data
    assert not [line for line in data.decode().splitlines() if line.startswith(forged[:10])]
    assert b"flux-tiny\\x0d\\x0a2026" in data, data[-2000:]


# --- 9. the smaller ones --------------------------------------------------------------------


def test_an_explicit_output_type_wins_over_accept(server):
    r = decode(server, [1, 16, 2, 2], output_type="pil", headers={"Accept": "video/mp4, image/png"})
    assert r.status_code == 200 and r.content[:4] == b"\x89PNG", r.text[:300]


def test_accept_q_values_are_honoured(server):
    r = decode(server, [1, 16, 2, 2], headers={"Accept": "image/png;q=0.5, image/webp"})
    assert r.status_code == 200 and r.headers["content-type"] == "image/webp"
    r = decode(server, [1, 16, 2, 2], headers={"Accept": "image/webp;q=0, image/jpeg;q=0.9"})
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"


def test_a_content_encoding_the_server_does_not_decode_is_a_415(server):
    body = gzip.compress(torch.randn(1, 16, 2, 2).numpy().tobytes())
    r = decode(server, [1, 16, 2, 2], body=body, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 415 and "Content-Encoding" in r.json()["error"], r.text[:300]
    ok = decode(server, [1, 16, 2, 2], headers={"Content-Encoding": "identity"})
    assert ok.status_code == 200


def test_geometry_params_that_do_not_fit_the_latent_are_a_422(server):
    r = decode(server, [1, 16, 2, 2], height="99999", output_type="pt")
    assert r.status_code == 422 and "height=99999" in r.json()["error"], r.text[:300]
    assert decode(server, [1, 16, 2, 2], height="16", width="16").status_code == 200
    packed = decode(
        server, [1, 4, 16], model="faulty-video", height="32", width="32", output_type="pt"
    )
    assert packed.status_code == 422 and "video model" in packed.json()["error"], packed.text


def test_error_bodies_do_not_echo_input_whole_or_leak_addresses(server):
    r = requests.post(f"{server}/decode/flux-tiny", params={"shape": "x" * 14000}, timeout=30)
    assert r.status_code == 422 and len(r.content) < 1000, len(r.content)
    r = requests.post(
        f"{server}/decode/flux-tiny",
        data=npy("f(1)", b""),
        headers={"Content-Type": "application/x-npy"},
        timeout=30,
    )
    assert r.status_code == 400 and " at 0x" not in r.text, r.text


def test_models_does_not_show_the_host_path_a_model_came_from(server):
    models = {m["name"]: m for m in requests.get(f"{server}/models", timeout=30).json()["models"]}
    assert models["imported"]["source"] == "ae-dir"
    assert "/srv/secret" not in requests.get(f"{server}/models", timeout=30).text


def test_head_probes_on_healthz_and_readyz(server):
    for path in ("/healthz", "/readyz"):
        r = requests.head(f"{server}{path}", timeout=30)
        assert r.status_code == 200 and not r.content, (path, r.status_code)


def test_the_trailing_slash_redirect_ignores_the_host_header(server):
    r = requests.get(
        f"{server}/healthz/?a=1", headers={"Host": "evil.example"}, allow_redirects=False
    )
    assert r.status_code == 307 and r.headers["Location"] == "/healthz?a=1"
    assert requests.get(f"{server}//evil.example/", allow_redirects=False).status_code == 404


def test_a_client_that_sends_its_headers_slowly_is_timed_out(store, tmp_path):
    env = {"VAE_MODELS": "flux-tiny", "VAE_HEADER_TIMEOUT_S": "1"}
    with faulty.serve_process(store, tmp_path / "serve.log", **env) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=0.2) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            t0, answer = time.monotonic(), b""
            while time.monotonic() - t0 < 15 and not answer:  # a byte of header every 0.2 s
                try:
                    s.sendall(b"X")
                    answer = s.recv(1024)
                except TimeoutError:
                    continue
                except OSError:
                    break
            elapsed = time.monotonic() - t0
        assert answer.startswith(b"HTTP/1.1 408"), (answer, elapsed)
        assert elapsed < 10, elapsed
        assert requests.get(f"{url}/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize("value", ["nan", "inf", "-Infinity", "1e999"])
@pytest.mark.parametrize("name", ["scaling_factor", "shift_factor"])
def test_a_non_finite_factor_names_a_real_expected_range(name, value):
    with pytest.raises(ProtocolError) as refused:
        parse_params([(name, value)])
    assert refused.value.status == 422 and "out of range" in refused.value.error
    assert refused.value.expected == "a finite number"  # not "None..None"


@pytest.mark.parametrize("name", ["seed", "quality", "frame", "height", "width"])
@pytest.mark.parametrize("digits", [309, 400, 4300])
def test_an_integer_past_a_float_is_out_of_range_not_a_500(name, digits):
    """An integer of 310 to 4300 digits overflowed the range check's float (OverflowError:
    a 500); it is compared as an integer now."""
    with pytest.raises(ProtocolError) as refused:
        parse_params([(name, "9" * digits)])
    assert refused.value.status == 422 and "out of range" in refused.value.error
    assert len(refused.value.error) < 200  # the value is clipped


@pytest.mark.parametrize("value", ["-1", "0", "-0.0"])
def test_a_deadline_that_is_not_positive_says_so(value):
    with pytest.raises(ProtocolError) as refused:
        parse_params([("timeout", value)])
    assert refused.value.status == 422 and refused.value.expected == "seconds > 0"


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ([("shape", "\u0664"), ("shape", "16")], "not a list of integers"),
        ([("shape", "1_0,16,4,4")], "not a list of integers"),
        ([("seed", "\u0661\u0662")], "not an integer"),
        ([("quality", "9\u0660")], "not an integer"),
        ([("timestep", "\u0665.0")], "not a number"),
        ([("dtype", "FLOAT32")], "dtype 'FLOAT32'"),
        ([("dtype", "Float16")], "dtype 'Float16'"),
    ],
)
def test_unicode_digits_and_other_spellings_are_refused(query, words):
    with pytest.raises(ProtocolError, match=words) as refused:
        parse_params(query)
    assert refused.value.status == 422


# --- issue 25: HTTP framing (7, 8, 10) and early answers (9), on the real `serve` process -----


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``python -m app serve`` (uvicorn with the service's own h11 protocol), bearer auth on,
    bodies capped at 1 MiB."""
    store = tmp_path_factory.mktemp("framing-store")
    with faulty.registered():
        faulty.bake(store, "faulty")
    log = tmp_path_factory.mktemp("framing-log") / "serve.log"
    env = {"VAE_API_TOKENS": "tok", "VAE_MAX_BODY_MB": "1", "VAE_MODELS": "faulty"}
    with faulty.serve_process(store, log, True, **env) as (url, _):
        yield url


AUTH = b"Authorization: Bearer tok\r\n"
DECODE = b"POST /decode/faulty?shape=[1,4,4,4]&output_type=pt HTTP/1.1\r\nHost: x\r\n"


def responses(data: bytes) -> list[tuple[int, bytes]]:
    """(status, head) of every response in ``data``."""
    heads = re.findall(rb"HTTP/1\.1 (\d{3})[^\r]*\r\n(.*?)\r\n\r\n", data, re.S)
    return [(int(code), head) for code, head in heads]


def test_content_length_with_transfer_encoding_is_refused_and_closes(served):
    """RFC 9112 6.3: a request framed twice gets a JSON 400 and the connection closes, so the
    request smuggled after its chunked body never runs (no second response)."""
    smuggled = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    head = DECODE + AUTH + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    received, error = upload_and_read(served, head + smuggled, 0)
    assert error == "" and [code for code, _ in responses(received)] == [400], received
    assert b"application/json" in received and b"framed twice" in received
    assert b"connection: close" in received.lower()


def test_repeated_content_encoding_headers_are_one_list(served):
    body = bytes(4 * 4 * 4 * 4)
    for encodings, status in (([b"identity"], 200), ([b"identity", b"gzip"], 415)):
        fields = b"".join(b"Content-Encoding: %s\r\n" % e for e in encodings)
        head = DECODE + AUTH + fields + b"Content-Length: %d\r\n\r\n" % len(body)
        received, _ = upload_and_read(served, head + body + b"GET /x HTTP/1.1\r\n", 0)
        assert responses(received)[0][0] == status, received[:300]


def test_a_malformed_request_is_a_json_400(served):
    received, _ = upload_and_read(served, b"GET /healthz HTTP/1.1\r\nbroken header\r\n\r\n", 0)
    ((status, head),) = responses(received)
    assert status == 400 and b"application/json" in head.lower(), received
    assert b"malformed HTTP request" in received


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        (AUTH + b"Content-Length: %d\r\n" % (64 << 20), 413),  # refused from Content-Length
        (b"Content-Length: %d\r\n" % (64 << 20), 401),  # refused before the body
    ],
    ids=["413", "401"],
)
def test_an_early_answer_reaches_a_client_still_uploading(served, fields, status):
    received, error = upload_and_read(served, DECODE + fields + b"\r\n", 64 << 20)
    assert error == "", (error, received[:200])
    assert responses(received)[0][0] == status and b"application/json" in received
