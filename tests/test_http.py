"""The HTTP service through a real uvicorn server on loopback.

diffusers' own ``remote_decode`` client is the caller; diffusers' ``AutoencoderKL`` with the
same weights is the oracle for what comes back.
"""

from __future__ import annotations

import io
import json
import threading

import numpy as np
import pytest
import requests
import torch
from diffusers import AutoencoderKL
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils.remote_utils import remote_decode
from PIL import Image
from safetensors.torch import save as save_safetensors

from app.store import load_model
from tests.helpers import cosine, latent
from tests.live import TINY_FLUX, live_server


@pytest.fixture(scope="module")
def oracle(flux_store):
    """diffusers AutoencoderKL holding the flux-tiny store weights."""
    _, ours = load_model(flux_store, "flux-tiny")
    cfg = TINY_FLUX["flux-tiny"]
    n = len(cfg["block_out_channels"])
    ref = AutoencoderKL(
        latent_channels=16,
        block_out_channels=cfg["block_out_channels"],
        layers_per_block=1,
        norm_num_groups=8,
        use_quant_conv=False,
        use_post_quant_conv=False,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
    ).eval()
    missing, _ = ref.load_state_dict(
        {f"decoder.{k}": v for k, v in ours.state_dict().items()}, strict=False
    )
    assert not [k for k in missing if k.startswith("decoder.")]
    return ref


def _expected_uint8(oracle, z: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        x = oracle.decode(z).sample
    return (
        VaeImageProcessor().postprocess(x, output_type="np").__mul__(255).round().astype(np.uint8)
    )


def test_remote_decode_png_matches_diffusers(flux_server, oracle):
    z = latent(1, 16, 8, 12)
    image = remote_decode(
        f"{flux_server}/decode/flux-tiny",
        z,
        do_scaling=False,
        output_type="pil",
        image_format="png",
    )
    assert image.size == (96, 64) and image.format == "png"
    diff = np.abs(np.asarray(image).astype(int) - _expected_uint8(oracle, z)[0].astype(int))
    assert diff.max() <= 1


def test_remote_decode_jpg(flux_server):
    image = remote_decode(
        f"{flux_server}/decode/flux-tiny",
        latent(1, 16, 8, 8),
        do_scaling=False,
        output_type="pil",
        image_format="jpg",
    )
    assert image.format == "jpeg" and image.size == (64, 64)


def test_remote_decode_pt_is_the_decoder_output(flux_server, oracle):
    z = latent(2, 16, 6, 10)
    got = remote_decode(
        f"{flux_server}/decode/flux-tiny", z, do_scaling=False, output_type="pt", return_type="pt"
    )
    with torch.no_grad():
        expected = oracle.decode(z).sample
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert cosine(got, expected) >= 0.99999


def test_remote_decode_pt_partial_postprocess(flux_server, oracle):
    z = latent(1, 16, 8, 8)
    got = remote_decode(
        f"{flux_server}/decode/flux-tiny",
        z,
        do_scaling=False,
        output_type="pt",
        partial_postprocess=True,
        return_type="pt",
    )
    assert got.dtype == torch.uint8 and got.shape == (1, 64, 64, 3)
    assert np.abs(got.numpy().astype(int) - _expected_uint8(oracle, z).astype(int)).max() <= 1


def test_remote_decode_with_processor_gets_unit_tensor(flux_server, oracle):
    z = latent(1, 16, 8, 8)
    images = remote_decode(
        f"{flux_server}/decode/flux-tiny",
        z,
        do_scaling=False,
        processor=VaeImageProcessor(),
        output_type="pil",
    )
    assert len(images) == 1 and images[0].size == (64, 64)
    diff = np.asarray(images[0]).astype(int) - _expected_uint8(oracle, z)[0].astype(int)
    assert np.abs(diff).max() <= 1


def test_remote_decode_packed_latents_with_factors(flux_server, oracle):
    z = latent(1, 16, 8, 12)
    packed = z.view(1, 16, 4, 2, 6, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, 24, 64)
    got = remote_decode(
        f"{flux_server}/decode/flux-tiny",
        packed,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        output_type="pt",
        return_type="pt",
        height=64,
        width=96,
    )
    with torch.no_grad():
        expected = oracle.decode(z / 0.3611 + 0.1159).sample
    assert cosine(got, expected) >= 0.99999


def test_do_scaling_applies_the_models_own_factors(flux_server, oracle):
    """remote_decode's default (do_scaling=True, no factors) sends do_scaling=True."""
    z = latent(1, 16, 8, 8)
    got = remote_decode(f"{flux_server}/decode/flux-tiny", z, output_type="pt", return_type="pt")
    with torch.no_grad():
        expected = oracle.decode(z / 0.3611 + 0.1159).sample
    assert cosine(got, expected) >= 0.99999


def test_flux2_do_scaling_uses_batchnorm_stats(flux_server, flux_store):
    _, ours = load_model(flux_store, "flux2-tiny")
    assert ours.bn.running_mean.abs().sum() > 0  # seeded stats, not the identity
    z = latent(1, 32, 8, 8)
    got = remote_decode(f"{flux_server}/decode/flux2-tiny", z, output_type="pt", return_type="pt")
    with torch.no_grad():
        expected = ours.decode(ours.denormalize(z))
    assert cosine(got, expected) >= 0.99999


def _post(url: str, body: bytes, params=None, headers=None) -> requests.Response:
    headers = {"Content-Type": "tensor/binary", **(headers or {})}
    return requests.post(url, data=body, params=params, headers=headers, timeout=60)


def test_webp_via_accept_and_other_bodies(flux_server):
    z = latent(1, 16, 8, 8)
    raw = _post(
        f"{flux_server}/decode",
        z.numpy().tobytes(),
        {"shape": "[1,16,8,8]", "model": "flux-tiny"},
        {"Accept": "image/webp"},
    )
    assert raw.status_code == 200 and raw.headers["content-type"] == "image/webp"
    assert Image.open(io.BytesIO(raw.content)).format == "WEBP"
    st = _post(
        f"{flux_server}/decode/flux-tiny",
        save_safetensors({"z": z[0]}),
        {"output_type": "pil", "image_format": "png"},
        {"Content-Type": "application/x-safetensors"},
    )
    buf = io.BytesIO()
    np.save(buf, z.numpy())
    npy = _post(
        f"{flux_server}/decode/flux-tiny",
        buf.getvalue(),
        {"image_format": "png"},
        {"Content-Type": "application/x-npy"},
    )
    assert st.status_code == npy.status_code == 200
    assert np.array_equal(
        np.asarray(Image.open(io.BytesIO(st.content))),
        np.asarray(Image.open(io.BytesIO(npy.content))),
    )


def test_every_response_has_timing_and_request_id(flux_server):
    ok = _post(
        f"{flux_server}/decode/flux-tiny",
        latent(1, 16, 4, 4).numpy().tobytes(),
        {"shape": [1, 16, 4, 4]},
        {"X-Request-Id": "sampler-42"},
    )
    bad = _post(f"{flux_server}/decode/flux-tiny", b"xx", {"shape": [1, 16, 4, 4]})
    for r in (ok, bad, requests.get(f"{flux_server}/healthz")):
        assert "X-Request-Id" in r.headers and "total;dur=" in r.headers["Server-Timing"]
    assert ok.headers["X-Request-Id"] == "sampler-42"
    # a sampler's own ids are kept; one that could split or escape a log line is replaced
    kept = ["job:42/step-3", "{6f9619ff-8b86-d011-b42d-00cf4fc964ff}", "a+b/c==", "x" * 128]
    for rid in kept + ["x" * 129, 'a"b', "a\\b", "a b", "\u00e9t\u00e9"]:
        r = requests.get(f"{flux_server}/healthz", headers={"X-Request-Id": rid.encode()})
        assert (r.headers["X-Request-Id"] == rid) == (rid in kept), (rid, r.headers)
    for phase in ("parse", "queue", "conv_in", "mid", "up_0", "up_1", "conv_out", "encode"):
        assert f"{phase};dur=" in ok.headers["Server-Timing"]


F32 = np.zeros((1, 16, 4, 4), np.float32).tobytes()
_npy = io.BytesIO()
np.save(_npy, np.zeros((1, 16, 4, 4), np.float32))
NPY = _npy.getvalue()
BAD_INPUTS = [
    # (id, path, body, params, headers, status, words in the error)
    ("short body", "/decode/flux-tiny", F32[:-4], {"shape": [1, 16, 4, 4]}, {}, 400, "bytes"),
    ("no shape", "/decode/flux-tiny", F32, {}, {}, 422, "shape"),
    ("two models", "/decode/flux-tiny", F32, {"shape": [1, 16, 4, 4], "model": "x"}, {}, 422,
     "?model= names 'x'"),
    ("packed, no size", "/decode/flux-tiny", F32, {"shape": [1, 4, 64]}, {}, 422, "1 channels"),
    ("batch over the limit", "/decode/flux-tiny", F32 * 9, {"shape": [9, 16, 4, 4]}, {}, 413,
     "batch 9"),
    ("shape garbage", "/decode/flux-tiny", F32, {"shape": "abc"}, {}, 422, "shape"),
    ("shape negative", "/decode/flux-tiny", F32, {"shape": [1, 16, -4, 4]}, {}, 422, "shape"),
    (
        "dtype",
        "/decode/flux-tiny",
        F32,
        {"shape": [1, 16, 4, 4], "dtype": "int64"},
        {},
        422,
        "dtype",
    ),
    ("channels", "/decode/flux-tiny", F32, {"shape": [1, 4, 8, 8]}, {}, 422, "channels"),
    (
        "nan",
        "/decode/flux-tiny",
        np.full((1, 16, 4, 4), np.nan, np.float32).tobytes(),
        {"shape": [1, 16, 4, 4]},
        {},
        422,
        "NaN",
    ),
    ("unknown model", "/decode/nope", F32, {"shape": [1, 16, 4, 4]}, {}, 404, "not found"),
    ("traversal", "/decode/..%2F..%2Fetc", F32, {"shape": [1, 16, 4, 4]}, {}, 404, ""),
    (
        "content type",
        "/decode/flux-tiny",
        F32,
        {"shape": [1, 16, 4, 4]},
        {"Content-Type": "image/png"},
        415,
        "Content-Type",
    ),
    (
        "safetensors",
        "/decode/flux-tiny",
        b"garbage!",
        {},
        {"Content-Type": "application/x-safetensors"},
        400,
        "safetensors",
    ),
    (
        "npy",
        "/decode/flux-tiny",
        b"\x93NUMPY garbage",
        {},
        {"Content-Type": "application/x-npy"},
        400,
        ".npy",
    ),
    (
        "output_type",
        "/decode/flux-tiny",
        F32,
        {"shape": [1, 16, 4, 4], "output_type": "gif"},
        {},
        422,
        "output_type",
    ),
    (
        "mp4 on image model",
        "/decode/flux-tiny",
        F32,
        {"shape": [1, 16, 4, 4], "output_type": "mp4"},
        {},
        422,
        "video",
    ),
    (
        "image of a batch",
        "/decode/flux-tiny",
        F32 * 2,
        {"shape": [2, 16, 4, 4]},
        {},
        422,
        "one image",
    ),
    (
        "packed mismatch",
        "/decode/flux-tiny",
        F32,
        {"shape": [1, 4, 64], "height": 64, "width": 64},
        {},
        422,
        "packed",
    ),
    (
        "bool",
        "/decode/flux-tiny",
        F32,
        {"shape": [1, 16, 4, 4], "do_scaling": "maybe"},
        {},
        422,
        "boolean",
    ),
    (
        "too many pixels",
        "/decode/flux-tiny",
        np.zeros((1, 16, 80, 80), np.float32).tobytes(),
        {"shape": [1, 16, 80, 80]},
        {},
        413,
        "pixels",
    ),
    (
        "body too large",
        "/decode/flux-tiny",
        b"\0" * (2 << 20),
        {"shape": [1, 16, 4, 4]},
        {},
        413,
        "limit",
    ),
    ("5-D on image model", "/decode/flux-tiny", F32, {"shape": [1, 16, 1, 4, 4]}, {}, 422, "video"),
    ("misspelled", "/decode/flux-tiny", F32, {"shape": [1, 16, 4, 4], "image_fromat": "png"},
     {}, 422, "unknown query parameter 'image_fromat'"),
    ("unknown", "/decode/flux-tiny", F32, {"shape": [1, 16, 4, 4], "tile_size": "64"}, {}, 422,
     "tile_size"),
    ("arabic digit", "/decode/flux-tiny", F32, {"shape": ["\u0664", 16, 4, 4]}, {}, 422,
     "not a list of integers"),
    ("upper dtype", "/decode/flux-tiny", F32, {"shape": [1, 16, 4, 4], "dtype": "FLOAT32"}, {},
     422, "dtype 'FLOAT32'"),
    ("unicode height", "/decode/flux-tiny", F32, {"shape": [1, 16, 4, 4], "height": "\u0663\u0662"},
     {}, 422, "not an integer"),
    ("npy data short", "/decode/flux-tiny", NPY[:-4], {}, {"Content-Type": "application/x-npy"},
     400, "data bytes"),
    ("seed of 400 digits", "/decode/flux-tiny", F32, {"shape": [1, 16, 4, 4], "seed": "9" * 400},
     {}, 422, "out of range"),
    ("two models, one long", "/decode/flux-tiny", F32, {"shape": [1, 16, 4, 4], "model": "b" * 5000},
     {}, 422, "?model= names 'bbb"),
]  # fmt: skip


@pytest.fixture(scope="module")
def strict_server(flux_store):
    with live_server(flux_store, dtype="float32", max_pixels=512 * 512, max_body_mb=1) as url:
        yield url


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_refused_with_a_json_4xx(strict_server, case):
    _, path, body, params, headers, status, words = case
    r = _post(f"{strict_server}{path}", body, params, headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error
    assert r.json().get("expected"), r.text  # every 4xx says what was wanted instead
    assert len(r.content) < 1024, r.text  # a client's value is repeated clipped


def test_an_unknown_param_is_named_with_every_accepted_one(strict_server):
    params = {"shape": [1, 16, 4, 4], "image_fromat": "png", "tile_size": "64"}
    r = _post(f"{strict_server}/decode/flux-tiny", F32, params)
    assert r.status_code == 422
    body = r.json()
    assert "'image_fromat'" in body["error"] and "'tile_size'" in body["error"]
    for name in ("image_format", "shape", "do_scaling", "timeout", "seed", "model"):
        assert name in body["expected"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"do_scaling": False, "output_type": "pt", "partial_postprocess": True},
        {"scaling_factor": 0.3611, "shift_factor": 0.1159, "image_format": "png"},
        {"do_scaling": True, "height": 64, "width": 64},
        {"output_type": "mp4"},
    ],
)
def test_every_param_remote_decode_and_remote_encode_send_is_accepted(kwargs):
    """diffusers' own request builders (what remote_decode / remote_encode send), read back
    through the service's strict parser: no name of theirs is refused."""
    from diffusers.utils.remote_utils import prepare_decode, prepare_encode

    from app.protocol import DECODE_PARAMS, ENCODE_PARAMS, parse_params

    sent = prepare_decode(torch.zeros(1, 16, 4, 4), **kwargs)["params"]
    assert set(sent) <= DECODE_PARAMS
    items = [(k, str(x)) for k, v in sent.items() for x in (v if isinstance(v, list) else [v])]
    parse_params(items)
    encode = prepare_encode(torch.zeros(1, 3, 8, 8), scaling_factor=0.3611, shift_factor=0.1)
    assert set(encode["params"]) <= ENCODE_PARAMS
    assert set(encode["params"]) <= DECODE_PARAMS  # shape, dtype and the factors


def test_models_readyz_and_metrics(flux_server):
    _post(f"{flux_server}/decode/flux-tiny", F32, {"shape": [1, 16, 4, 4], "output_type": "pt"})
    models = {m["name"]: m for m in requests.get(f"{flux_server}/models").json()["models"]}
    assert set(models) == set(TINY_FLUX)
    assert models["flux-tiny"]["family"] == "flux" and models["flux-tiny"]["parity_cosine"] == 1.0
    assert requests.get(f"{flux_server}/readyz").status_code == 200
    text = requests.get(f"{flux_server}/metrics").text
    for needle in (
        'vae_phase_seconds_count{device="cpu",model="flux-tiny",phase="up_0"}',
        'vae_span_seconds_bucket{le="0.005",model="flux-tiny",span="decode"}',
        'vae_requests_total{code="200",model="flux-tiny",output="tensor"}',
        'vae_request_seconds_count{code_class="2xx",kind="tensor",model="flux-tiny"}',
        'vae_parity_cosine{model="flux-tiny"} 1.0',
        'vae_fallback_active{model="flux-tiny"} 0.0',
        'vae_model_load_seconds{model="flux-tiny",phase="total"}',
        "vae_queue_depth",
        "vae_inflight",
        'vae_device_memory_bytes{device="cpu",kind="allocated"}',
        'vae_device_memory_bytes{device="cpu",kind="peak"}',
    ):
        assert needle in text, needle
    assert "_created" not in text  # billed series nobody reads


def _sample(text: str, name: str, **labels: str) -> float:
    """One sample of an exposition by name and labels (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_every_outcome_is_timed_with_its_code_class(flux_server):
    """Refused and failed requests count in the latency histogram too, by code class, and
    its buckets reach Cloud Run's request timeout (3600 s, deploy/cloudrun/service.yaml)."""
    labels = dict(model="flux-tiny", kind="-", code_class="4xx")
    before = _sample(requests.get(f"{flux_server}/metrics").text, "vae_request_seconds_count",
                     **labels)  # fmt: skip
    r = _post(f"{flux_server}/decode/flux-tiny", F32, {"shape": [1, 4, 4, 4]})  # wrong size
    assert 400 <= r.status_code < 500, r.text
    text = requests.get(f"{flux_server}/metrics").text
    assert _sample(text, "vae_request_seconds_count", **labels) == before + 1
    assert _sample(text, "vae_request_seconds_bucket", le="3600.0", **labels) == before + 1
    rss = _sample(text, "vae_device_memory_bytes", device="cpu", kind="allocated")
    assert 10 * 2**20 < rss < 64 * 2**30  # the process's resident set, read at the scrape


def test_full_queue_answers_429_with_retry_after(flux_store):
    """One worker, a queue of one, a burst of slow decodes: the overflow is shed, not lost."""
    z = np.zeros((1, 16, 56, 56), np.float32).tobytes()
    results: list[requests.Response] = []
    with live_server(flux_store, dtype="float32", queue_depth=1, max_batch=1, batch_rows=1) as url:

        def call() -> None:
            results.append(_post(f"{url}/decode/flux-tiny", z, {"shape": [1, 16, 56, 56]}))

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    codes = sorted(r.status_code for r in results)
    assert len(results) == 8 and set(codes) <= {200, 429}, codes
    assert 429 in codes and 200 in codes
    for r in results:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1 and "queue" in r.json()["error"]


def test_openapi_documents_the_binary_body(flux_server):
    spec = requests.get(f"{flux_server}/openapi.json").json()
    body = spec["paths"]["/decode/{model}"]["post"]["requestBody"]["content"]
    assert {"tensor/binary", "application/x-safetensors", "application/x-npy"} <= set(body)
    assert json.dumps(spec)  # serialisable


def test_bodies_are_parsed_on_the_intake_pool_never_on_the_event_loop(flux_server, monkeypatch):
    """A large body's parse and checks take seconds: on the event loop they would stop every
    other request (a 256 MiB column-order .npy stopped /healthz for 10 s). Where each runs."""
    import threading

    import app.protocol

    where: list[str] = []

    def recorded(parse):
        def run(*args, **kwargs):
            where.append(threading.current_thread().name)
            return parse(*args, **kwargs)

        return run

    monkeypatch.setattr(app.protocol, "parse_body", recorded(app.protocol.parse_body))
    monkeypatch.setattr(app.protocol, "check_scaling", recorded(app.protocol.check_scaling))
    z = latent(1, 16, 4, 4)
    r = _post(f"{flux_server}/decode/flux-tiny", z.numpy().tobytes(), {"shape": [1, 16, 4, 4]})
    assert r.status_code == 200, r.text
    assert len(where) == 2 and all(name.startswith("intake") for name in where), where
