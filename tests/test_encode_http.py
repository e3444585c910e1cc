"""``POST /encode`` on a live uvicorn server: diffusers' real ``remote_encode`` unchanged, the
latent against the in-process exact encoder, the real TAEF2 round trip on real photos, a
video family's MP4 body, and every refusal as a JSON 4xx.

The store: a tiny FLUX.1 entry with its encoder, the same decoder alone (decoder-only), the
synthetic ``ltx-tiny`` (decoder + encoder), and TAEF2 imported from ``../shared/weights/taef2``
with the real CLI (its tests skip when the weights are absent).
"""

from __future__ import annotations

import io
import json
import math
import struct
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from PIL import Image

from app.families import family
from app.families.ops import cosine
from app.store import load_encoder, read_manifest, write_model
from tests import launch
from tests.conftest import SHARED, shared_path
from tests.live import ROOT, bake, cli_import, live_server

FLUX_TINY = {
    "latent_channels": 16,
    "block_out_channels": [16, 32, 32, 32],
    "layers_per_block": 1,
    "norm_num_groups": 8,
}
FLUX1_FACTORS = {"scaling_factor": 0.3611, "shift_factor": 0.1159}
TAEF2 = SHARED / "weights" / "taef2"  # tests skip where it is absent (_taef2)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    from app.families.ltx.decoder.synthetic import SYNTHETIC as LTX_DECODERS
    from app.families.ltx.encoder.synthetic import SYNTHETIC as LTX_ENCODERS

    store = tmp_path_factory.mktemp("encode-store")
    bake(store, "flux", "flux-enc", FLUX_TINY, encoder=True)
    bake(store, "flux", "flux-dec", FLUX_TINY)
    ltx = family("ltx").encoder
    decoder = family("ltx").decoder.module(LTX_DECODERS["ltx-tiny"])
    encoder = ltx.module(LTX_ENCODERS["ltx-tiny"])
    ltx.init_synthetic(encoder, torch.Generator().manual_seed(1))
    write_model(
        store,
        "ltx-tiny",
        "ltx",
        LTX_DECODERS["ltx-tiny"],
        decoder.state_dict(),
        source="test",
        dtype="float32",
        encoder_state=encoder.state_dict(),
        encoder_config=LTX_ENCODERS["ltx-tiny"],
    )
    if (TAEF2 / "taef2_encoder.pth").exists():
        imports = [("taesd", TAEF2, "taef2"), ("taesd", TAEF2 / "taef2_decoder.pth", "taef2-dec")]
        cli_import(store, *imports, references=False)  # served float32 exact: none gated
    return store


@pytest.fixture(scope="module")
def url(store):
    with live_server(store, dtype="float32", default_model="flux-enc") as url:
        yield url


def exact_encoder(store: Path, name: str):
    """The entry's encoder, loaded in process as the service's exact path is (float32, CPU)."""
    _, manifest = read_manifest(store, name)
    _, state = load_encoder(store, name)
    encoder = family(manifest.family).encoder.module(manifest.encoder_config).eval()
    encoder.load_state_dict(state)
    return encoder.float()


def diffusers_pixels(image: Image.Image, scale: int = 8) -> torch.Tensor:
    """What a diffusers pipeline hands ``vae.encode``: the oracle of the image preprocessing."""
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(vae_scale_factor=scale).preprocess(image.convert("RGB")).float()


def latent_of(r: requests.Response) -> torch.Tensor:
    assert r.status_code == 200, r.text
    assert r.headers["dtype"] == "float32"
    data = torch.frombuffer(bytearray(r.content), dtype=torch.float32)
    return data.reshape(json.loads(r.headers["shape"]))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def photo(name: str) -> Image.Image:
    path = shared_path("data", f"{name}.png")
    if not path.exists():
        pytest.skip(f"{path} is absent (a user's clone has none)")
    return Image.open(path).convert("RGB")


def test_models_show_each_encoder(url):
    models = {m["name"]: m for m in requests.get(f"{url}/models").json()["models"]}
    enc = models["flux-enc"]["encoder"]
    assert enc["dtype"] == "float32" and enc["path"] in ("exact", "optimized")
    assert enc["parity_cosine"] >= 0.99999 and enc["fallback"] is False
    # VAE_DTYPE=float32 on the CPU: the exact encoder is the one candidate, served unmeasured
    # (as a decoder is: app/runtime/selection.choose)
    assert enc["mode"] == "float32 exact" and enc["selection"] == "done"
    assert enc["chosen_because"] == "the only candidate: the exact path"
    (only,) = enc["candidates"]
    assert only["mode"] == "float32 exact" and only["passed"] is True
    assert models["flux-dec"]["encoder"] is None
    assert models["ltx-tiny"]["encoder"]["video"] is True


@torch.inference_mode()
def test_remote_encode_image_matches_the_exact_encoder(url, store):
    from diffusers.utils.remote_utils import remote_encode

    image = Image.fromarray(np.asarray(photo("chelsea"))[:100, :131])  # resized to 128x96
    got = remote_encode(f"{url}/encode/flux-enc", image, **FLUX1_FACTORS)
    mean = exact_encoder(store, "flux-enc").encode(diffusers_pixels(image))
    want = (mean - FLUX1_FACTORS["shift_factor"]) * FLUX1_FACTORS["scaling_factor"]
    assert got.shape == want.shape == (1, 16, 12, 16)
    assert cosine(got, want) >= 0.99999
    # the model's own normalisation (FLUX.1: the same factors, from its config)
    r = requests.post(f"{url}/encode/flux-enc?do_scaling=true", data=png_bytes(image))
    assert cosine(latent_of(r), want) >= 0.99999
    raw = requests.post(f"{url}/encode/flux-enc", data=png_bytes(image))
    assert cosine(latent_of(raw), mean) >= 0.99999 and cosine(latent_of(raw), want) < 0.999


@torch.inference_mode()
def test_remote_encode_tensor_and_formats(url, store):
    from diffusers.utils.remote_utils import remote_encode
    from safetensors.torch import load

    x = torch.rand(2, 3, 48, 40, generator=torch.Generator().manual_seed(5)) * 2 - 1
    got = remote_encode(f"{url}/encode?model=flux-enc", x)
    want = exact_encoder(store, "flux-enc").encode(x)
    assert got.shape == want.shape and cosine(got, want) >= 0.99999
    params = {"shape": list(x.shape), "dtype": "float32"}
    body = x.numpy().tobytes()
    r = requests.post(
        f"{url}/encode/flux-enc", params=params, data=body, headers={"Accept": "application/x-npy"}
    )
    assert r.headers["content-type"] == "application/x-npy"
    assert torch.equal(torch.from_numpy(np.load(io.BytesIO(r.content))), got)
    accept = {"Accept": "application/x-safetensors"}
    r = requests.post(f"{url}/encode/flux-enc", params=params, data=body, headers=accept)
    assert torch.equal(load(r.content)["latent"], got)
    buffer = io.BytesIO()
    np.save(buffer, x.numpy())
    npy = {"Content-Type": "application/x-npy"}
    r = requests.post(f"{url}/encode/flux-enc", data=buffer.getvalue(), headers=npy)
    assert torch.equal(latent_of(r), got)


@torch.inference_mode()
def test_sample_is_seeded_and_packed_is_fluxs_layout(url, store):
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    x = torch.rand(1, 3, 64, 96, generator=torch.Generator().manual_seed(6)) * 2 - 1
    params = {"shape": list(x.shape), "dtype": "float32"}

    def encode(**extra) -> torch.Tensor:
        q = {**params, **{k: str(v).lower() for k, v in extra.items()}}
        return latent_of(
            requests.post(f"{url}/encode/flux-enc", params=q, data=x.numpy().tobytes())
        )

    a, b, c = encode(sample=True, seed=7), encode(sample=True, seed=7), encode(sample=True, seed=8)
    mean = encode()
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, mean)
    encoder = exact_encoder(store, "flux-enc")
    want = encoder.encode(x, sample=True, generator=torch.Generator().manual_seed(7))
    assert cosine(a, want) >= 0.99999
    packed = encode(packed=True)
    assert torch.equal(packed, FluxPipeline._pack_latents(mean, 1, 16, 8, 12))


def _huge_png(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width x height`` (valid CRC) and holds almost no data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


@pytest.mark.parametrize(
    "path, params, body, headers, status, says",
    [
        ("/encode/flux-dec", {}, "png", {}, 404, "decoder-only"),
        ("/encode/nope", {}, "png", {}, 404, "not found"),
        ("/encode/flux-enc", {"bogus": "1"}, "png", {}, 422, "unknown query parameter"),
        ("/encode/flux-enc", {}, b"hello", {"Content-Type": "text/plain"}, 415, "text/plain"),
        ("/encode/flux-enc", {}, b"hello", {}, 415, "not a PNG"),
        ("/encode/flux-enc", {}, "huge", {}, 413, "exceeds the limit"),  # Pillow's bound
        ("/encode/flux-enc", {}, "5k", {}, 413, "input 5000x5000 exceeds the limit"),  # ours
        ("/encode/flux-enc", {}, b"\x89PNG\r\n\x1a\nbroken", {}, 400, "not a valid"),
        ("/encode/flux-enc", {}, b"hello", {"Content-Type": "image/png"}, 400, "not a valid"),
        ("/encode/flux-enc", {}, b"\0" * 12, {"Content-Type": "tensor/binary"}, 422, "shape"),
        ("/encode/flux-enc", {"shape": [1, 3, 9000, 9000]}, b"\0" * 12, {}, 413, "limit"),
        ("/encode/flux-enc", {"shape": [1, 4, 64, 64]}, b"\0" * 12, {}, 422, "[B,3,H,W]"),
        ("/encode/flux-enc", {"shape": [1, 3, 8, 8]}, b"\0" * 12, {}, 400, "needs 768"),
        ("/encode/flux-enc", {"seed": "3"}, "png", {}, 422, "sample=true"),
        ("/encode/flux-enc", {}, b"\0\0\0 ftypisom", {"Content-Type": "video/mp4"}, 415, "video"),
        ("/encode/ltx-tiny", {"shape": [1, 3, 9, 40, 64]}, b"\0", {}, 422, "not a multiple of"),
        ("/encode/ltx-tiny", {"packed": "true"}, "png", {}, 422, "FLUX"),
    ],
)
def test_bad_input_gets_a_json_4xx(url, path, params, body, headers, status, says):
    if body == "png":
        body = png_bytes(Image.new("RGB", (64, 64), "red"))
    elif body == "huge":
        body = _huge_png(100_000, 100_000)
    elif body == "5k":
        body = _huge_png(5000, 5000)
    r = requests.post(f"{url}{path}", params=params, data=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    assert says in r.json()["error"], r.json()
    assert " at 0x" not in r.text, r.text  # a parser's object repr, without its address


def _mp4(frames: np.ndarray, fps: int = 8) -> bytes:
    import imageio_ffmpeg

    t, h, w, _ = frames.shape
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/clip.mp4"
        writer = imageio_ffmpeg.write_frames(path, (w, h), fps=fps, macro_block_size=1)
        writer.send(None)
        for frame in frames:
            writer.send(np.ascontiguousarray(frame))
        writer.close()
        return Path(path).read_bytes()


def _mp4_frames(data: bytes) -> torch.Tensor:
    """The MP4's frames as ffmpeg decodes them, ``[1,3,T,H,W]`` in [-1, 1]."""
    import imageio_ffmpeg

    with tempfile.NamedTemporaryFile(suffix=".mp4") as file:
        file.write(data)
        file.flush()
        reader = imageio_ffmpeg.read_frames(file.name, pix_fmt="rgb24")
        w, h = next(reader)["size"]
        frames = [np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader]
    x = torch.from_numpy(np.stack(frames)).float().permute(3, 0, 1, 2)[None]
    return x / 127.5 - 1


@torch.inference_mode()
def test_video_family_encodes_an_mp4(url, store):
    gen = np.random.default_rng(3)
    base = gen.integers(0, 255, (1, 64, 96, 3)).astype(np.float32)
    frames = np.clip(base + gen.normal(0, 8, (9, 64, 96, 3)), 0, 255).astype(np.uint8)
    data = _mp4(frames)
    r = requests.post(f"{url}/encode/ltx-tiny", data=data, headers={"Content-Type": "video/mp4"})
    got = latent_of(r)
    encoder = exact_encoder(store, "ltx-tiny")
    want = encoder.encode(_mp4_frames(data))
    assert got.shape == want.shape and got.shape[2] == encoder.latent_frames(9) > 1
    assert cosine(got, want) >= 0.99999
    # the same frames as a raw 5-D tensor
    x = _mp4_frames(data)
    params = {"shape": list(x.shape), "dtype": "float32", "do_scaling": "true"}
    r = requests.post(f"{url}/encode/ltx-tiny", params=params, data=x.numpy().tobytes())
    assert cosine(latent_of(r), encoder.normalize(want)) >= 0.99999


def _taef2(store: Path) -> None:
    if not (TAEF2 / "taef2_encoder.pth").exists():
        pytest.skip("../shared/weights/taef2 is absent (a user's clone has none)")


def test_taef2_import_brings_the_encoder_and_a_decoder_file_is_decoder_only(url, store):
    _taef2(store)
    assert set(read_manifest(store, "taef2")[1].parts) == {"decoder", "encoder"}
    assert set(read_manifest(store, "taef2-dec")[1].parts) == {"decoder"}
    r = requests.post(f"{url}/encode/taef2-dec", data=png_bytes(Image.new("RGB", (64, 64))))
    assert r.status_code == 404 and "decoder-only" in r.json()["error"]


@torch.inference_mode()
def test_taef2_round_trip_on_a_real_photo_over_http(url, store):
    """remote_encode -> the real TAEF2 encoder -> /decode -> the real TAEF2 decoder: >= 28 dB
    against the image as preprocessed (resized to a multiple of 8), the latent exact. The
    smallest photo, of an odd size (the path is the same for any; every photo's round trip is
    scored in-process: tests/test_encoder_taesd.py)."""
    from diffusers.utils.remote_utils import remote_encode

    _taef2(store)
    name = "chelsea"
    image = photo(name)
    latent = remote_encode(f"{url}/encode/taef2", image)
    pixels = diffusers_pixels(image)
    assert cosine(latent, exact_encoder(store, "taef2").encode(pixels)) >= 0.99999
    query = {"shape": list(latent.shape), "dtype": "float32", "output_type": "pt"}
    query["partial_postprocess"] = "true"
    r = requests.post(
        f"{url}/decode/taef2", params=query, data=latent.numpy().tobytes(), timeout=300
    )
    assert r.status_code == 200, r.text
    decoded = np.frombuffer(r.content, np.uint8).reshape(json.loads(r.headers["shape"]))[0]
    original = ((pixels[0].permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).numpy()
    mse = float(np.mean((decoded.astype(np.float64) - original) ** 2))
    psnr = 10 * math.log10(255**2 / mse)
    print(f"{name} {image.size} TAEF2 round trip over HTTP: {psnr:.2f} dB")
    assert psnr >= 28


def test_encode_metrics_use_encoder_phases(url):
    requests.post(f"{url}/encode/flux-enc", data=png_bytes(Image.new("RGB", (32, 32), "blue")))
    text = requests.get(f"{url}/metrics").text
    assert 'phase="encoder.conv_in"' in text and 'phase="encoder.normalize"' in text
    assert 'vae_requests_total{code="200",model="flux-enc",output="latent"}' in text


def test_bake_writes_synthetic_encoders(tmp_path):
    names = ["wan2.1-tiny", "minimax-h3-image-tiny"]
    command = [sys.executable, "-m", "app", "bake", "--synthetic", "--only", *names]
    command += ["--no-references"]  # the parts are the point (references: test_startup.py)
    run = launch.run(
        [*command, "--models-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert set(read_manifest(tmp_path, "wan2.1-tiny")[1].parts) == {"decoder", "encoder"}
    assert set(read_manifest(tmp_path, "minimax-h3-image-tiny")[1].parts) == {"decoder"}


def test_declared_limits_are_refused_before_the_body_is_sent(url):
    from tests.helpers import raw_request, read_response

    target = "/encode/flux-enc?shape=[1,3,9000,9000]&dtype=float32"
    sock = raw_request(url, target, headers={"Transfer-Encoding": "chunked"})
    status, body = read_response(sock)  # no body byte was sent
    assert status == 413 and "limit" in body["error"]
    png = {"Content-Type": "image/png", "Content-Length": "900000000"}
    status, body = read_response(raw_request(url, "/encode/flux-enc", headers=png))
    assert status == 413 and "limit" in body["error"]


def test_an_encode_that_never_fits_the_host_is_413_before_its_body(store, url):
    """Encoders never tile: pixels whose one run plans more than the capped host could ever
    hold are refused from their declared shape, before the body is sent; uncapped, the same
    pixels encode."""
    from tests.helpers import raw_request, read_response

    pixels = torch.zeros(1, 3, 256, 256)
    target = "/encode/flux-enc?shape=[1,3,256,256]&dtype=float32"
    length = {"Content-Length": str(pixels.nbytes)}
    with live_server(store, dtype="float32", device_memory_gb=1e-6) as capped:
        status, body = read_response(raw_request(capped, target, headers=length))
    assert status == 413 and "one run here can plan at most 0.0 MiB" in body["error"], body
    r = requests.post(url + target, data=pixels.numpy().tobytes())
    assert r.status_code == 200, r.text


def test_serve_encoders_false_decodes_only(store):
    with live_server(store, dtype="float32", serve_encoders=False) as url:
        models = requests.get(f"{url}/models").json()["models"]
        assert all(m["encoder"] is None for m in models)
        r = requests.post(f"{url}/encode/flux-enc", data=png_bytes(Image.new("RGB", (64, 64))))
        assert r.status_code == 404 and "VAE_SERVE_ENCODERS" in r.json()["error"]
