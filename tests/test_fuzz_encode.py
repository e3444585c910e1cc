"""Hostile input to the encode path, generated: any query, headers and body bytes (broken
images, lying tensor headers, damaged MP4s) become an ``EncodeRequest`` whose pixels can be
read to the end, or a ``ProtocolError`` (a 4xx, or a 503 for memory), never another
exception and never a hang. The bodies start from real PNG/JPEG/WebP/npy/safetensors/MP4 bytes
and are truncated, overwritten or replaced. schemathesis drives the live ``/encode`` routes
from the OpenAPI schema in tests/test_openapi.py."""

from __future__ import annotations

import asyncio
import io
import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from app.media.mp4 import encode_mp4
from app.media.read import Mp4Clip
from app.protocol import ProtocolError
from app.protocol.encode import EncodeHead, EncoderGeometry, parse_encode_head, validate_encode
from app.protocol.params import ENCODE_PARAMS
from app.protocol.shapes import Limits
from tests.test_fuzz import FUZZ, TRICKY, no_hang

LIMITS = Limits(max_body_bytes=1 << 16, max_pixels=128 * 128, max_frames=17, max_batch=2)


def _ltx_frames(frames: int) -> str:
    return "" if (frames - 1) % 8 == 0 else f"LTX encodes 1 + 8k frames: {frames} is not one"


GEOMETRIES = [  # an image encoder, a video one that takes any count, one with a frame rule
    EncoderGeometry("flux", 8, False, lambda shape: 1 << 20),
    EncoderGeometry("wan", 8, True, lambda shape: 1 << 20),
    EncoderGeometry("ltx", 32, True, lambda shape: 1 << 20, _ltx_frames),
]


def _image(fmt: str, mode: str = "RGB", size: tuple[int, int] = (24, 16)) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    image = Image.fromarray(pixels).convert(mode)
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def _npy(shape: tuple[int, ...]) -> bytes:
    out = io.BytesIO()
    np.save(out, np.zeros(shape, np.float32))
    return out.getvalue()


def _safetensors(shape: tuple[int, ...]) -> bytes:
    data = np.zeros(shape, np.float32).tobytes()
    header = json.dumps(
        {"pixels": {"dtype": "F32", "shape": shape, "data_offsets": [0, len(data)]}}
    )
    return struct.pack("<Q", len(header)) + header.encode() + data


def _mp4(frames: int = 9) -> bytes:
    ramp = np.linspace(0, 255, 32 * 32 * 3, dtype=np.uint8).reshape(32, 32, 3)
    return b"".join(encode_mp4((np.roll(ramp, t, 0) for t in range(frames)), fps=8, threads=1))


SEEDS = {  # content type -> a valid body of it
    "image/png": _image("PNG"),
    "image/png;grey16": _image("PNG", "I;16"),
    "image/jpeg": _image("JPEG"),
    "image/webp": _image("WEBP"),
    "application/x-npy": _npy((1, 3, 16, 16)),
    "application/x-safetensors": _safetensors((1, 3, 16, 16)),
    "video/mp4": _mp4(),
}
CONTENT_TYPES = [None, "", "tensor/binary", "image/png", "image/jpeg", "image/webp", "video/mp4"]
CONTENT_TYPES += ["application/x-npy", "application/x-safetensors", "text/plain", "image/gif"]


@st.composite
def bodies(draw) -> tuple[str | None, bytes]:
    """A content type and a body: a valid seed of some type, damaged or not, under any type."""
    seed_type = draw(st.sampled_from(sorted(SEEDS) + ["video/mp4"] * 3))  # MP4: the most parts
    body = bytearray(SEEDS[seed_type])
    for _ in range(draw(st.integers(0, 2))):
        how = draw(st.sampled_from(["truncate", "overwrite", "overwrite", "insert"]))
        at = draw(st.integers(0, max(len(body) - 1, 0)))
        if how == "truncate":
            del body[max(at, len(body) // 3) :]  # a cut in the data more often than the header
        elif how == "overwrite":
            junk = draw(st.binary(min_size=1, max_size=16))
            body[at : at + len(junk)] = junk
        else:
            body[at:at] = draw(st.binary(min_size=1, max_size=64))
    if draw(st.integers(0, 9)) == 0:
        body = bytearray(draw(st.binary(max_size=512)))
    declared = (
        seed_type.split(";")[0] if draw(st.booleans()) else draw(st.sampled_from(CONTENT_TYPES))
    )
    return declared, bytes(body)


values = st.one_of(st.sampled_from(TRICKY), st.text(max_size=30))
keys = st.one_of(st.sampled_from(sorted(ENCODE_PARAMS) + ["sample", "packed"]), st.text(max_size=8))
queries = st.lists(st.tuples(keys, values), max_size=8)
header_names = st.sampled_from(["content-encoding", "x-request-timeout", "accept", "x-other"])
headers = st.lists(st.tuples(header_names, values), max_size=4)


def refused(exc: ProtocolError) -> None:
    assert 400 <= exc.status < 500 or exc.status == 503, exc.status
    assert exc.body()["error"], exc.status


def encode_pipeline(head: EncodeHead, body: bytes, geo: EncoderGeometry) -> None:
    """What the service does with an encode's body before and while the encoder reads it:
    validate, then read every pixel (an MP4 clip window by window, as the encoder does)."""

    def read_body(limit: int) -> bytes:
        if len(body) > limit:
            raise ProtocolError(413, "body too large")
        return body

    try:
        with no_hang(10.0):
            request = asyncio.run(validate_encode(head, geo, LIMITS, read_body))
            pixels = request.pixels
            if isinstance(pixels, Mp4Clip):
                try:
                    frames = pixels.shape[2]
                    for start in range(0, frames, 4):
                        try:
                            window = pixels.window(start, min(start + 4, frames))
                        except ValueError:  # damage past the probe: the runner answers 422
                            break
                        assert bool(torch.isfinite(window).all())
                        pixels.release(start + 4)
                finally:
                    pixels.close()
            else:
                assert pixels.dtype == torch.float32 and pixels.shape[1] == 3, pixels.shape
    except ProtocolError as exc:
        refused(exc)


@FUZZ
@given(queries, headers)
def test_any_encode_params_and_headers_parse_or_are_refused_with_a_4xx(query, pairs):
    try:
        with no_hang():
            head = parse_encode_head(query, pairs)
    except ProtocolError as exc:
        refused(exc)
    else:
        assert head.timeout is None or head.timeout > 0
        assert head.params.seed is None or head.sample


@pytest.mark.parametrize("geo", GEOMETRIES, ids=[g.family for g in GEOMETRIES])
@FUZZ
@given(bodies(), st.booleans(), st.sampled_from([None, "application/x-npy", "text/html"]))
def test_any_encode_body_becomes_pixels_or_a_4xx(geo, body, packed, accept):
    content_type, data = body
    query = [("packed", "true")] if packed else []
    pairs = [("content-type", content_type)] if content_type is not None else []
    pairs += [("accept", accept)] if accept else []
    try:
        head = parse_encode_head(query, pairs)
    except ProtocolError as exc:
        refused(exc)
        return
    encode_pipeline(head, data, geo)


@pytest.mark.parametrize("content_type", sorted(SEEDS))
def test_every_seed_body_is_read_as_pixels(content_type):
    """The fuzzing starts from bodies the service reads: each seed alone becomes pixels."""
    declared = content_type.split(";")[0]
    geo = GEOMETRIES[1] if declared == "video/mp4" else GEOMETRIES[0]
    head = parse_encode_head([], [("content-type", declared)])
    read = asyncio.run(validate_encode(head, geo, LIMITS, lambda limit: SEEDS[content_type]))
    shape = tuple(read.pixels.shape)
    if isinstance(read.pixels, Mp4Clip):
        read.pixels.close()
    size = {"video/mp4": (32, 32), "application/x-npy": (16, 16)}.get(declared, (16, 24))
    size = (16, 16) if declared == "application/x-safetensors" else size
    assert shape[:2] == (1, 3) and shape[-2:] == size, shape
