"""Untrusted media bodies (``app/media/read.py``): ``POST /encode`` on a live server and
``python -m app encode``'s reader never let ffmpeg open a file a body names (ffconcat, DASH,
HLS), refuse a non-MP4 declared ``video/mp4``, keep ffmpeg's banner and host paths out of
error bodies, refuse an MP4 past the frame or pixel limit before decoding it, keep ffmpeg
within a memory bound whatever an MP4 claims, refuse a JPEG of too many scans before decoding
it, and read every PNG mode (16-bit grey included) as the pixels it means.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from PIL import Image

from app.families import family
from app.families.ops import cosine
from app.store import load_encoder, read_manifest, write_model
from tests.live import live_server

FLUX_TINY = {
    "latent_channels": 16,
    "block_out_channels": [16, 32, 32, 32],
    "layers_per_block": 1,
    "norm_num_groups": 8,
}
MAX_FRAMES = 16
MAX_PIXELS = 512 * 512
MP4 = {"Content-Type": "video/mp4"}


def _ffmpeg() -> str:
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """flux-enc (an image encoder) and ltx-tiny (a video encoder), seeded."""
    from app.families.ltx.decoder.synthetic import SYNTHETIC as LTX_DECODERS
    from app.families.ltx.encoder.synthetic import SYNTHETIC as LTX_ENCODERS

    store = tmp_path_factory.mktemp("media-store")
    for name, key, dec_config, enc_config in (
        ("flux-enc", "flux", FLUX_TINY, FLUX_TINY),
        ("ltx-tiny", "ltx", LTX_DECODERS["ltx-tiny"], LTX_ENCODERS["ltx-tiny"]),
    ):
        described = family(key)
        decoder = described.decoder.module(dec_config)
        described.decoder.init_synthetic(decoder, torch.Generator().manual_seed(0))
        encoder = described.encoder.module(enc_config)
        described.encoder.init_synthetic(encoder, torch.Generator().manual_seed(1))
        write_model(
            store,
            name,
            key,
            dec_config,
            decoder.state_dict(),
            source="test",
            dtype="float32",
            encoder_state=encoder.state_dict(),
            encoder_config=enc_config,
        )
    return store


@pytest.fixture(scope="module")
def url(store):
    settings = {"max_frames": MAX_FRAMES, "max_pixels": MAX_PIXELS}
    with live_server(store, dtype="float32", default_model="flux-enc", **settings) as url:
        yield url


def exact_encoder(store: Path, name: str) -> torch.nn.Module:
    _, manifest = read_manifest(store, name)
    _, state = load_encoder(store, name)
    encoder = family(manifest.family).encoder.module(manifest.encoder_config).eval()
    encoder.load_state_dict(state)
    return encoder.float()


def latent_of(r: requests.Response) -> torch.Tensor:
    assert r.status_code == 200, r.text
    data = torch.frombuffer(bytearray(r.content), dtype=torch.float32)
    return data.reshape(json.loads(r.headers["shape"]))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def mp4_of(frames: np.ndarray) -> bytes:
    """uint8 ``[T, H, W, 3]`` -> an H.264 MP4 (imageio-ffmpeg's writer)."""
    import imageio_ffmpeg

    t, h, w, _ = frames.shape
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/clip.mp4"
        writer = imageio_ffmpeg.write_frames(path, (w, h), fps=8, macro_block_size=1)
        writer.send(None)
        for frame in frames:
            writer.send(np.ascontiguousarray(frame))
        writer.close()
        return Path(path).read_bytes()


def pattern_mp4(size: str, frames: int) -> bytes:
    """ffmpeg's ``testsrc`` as an H.264 MP4: many frames from a few bytes."""
    with tempfile.TemporaryDirectory() as folder:
        out = f"{folder}/clip.mp4"
        command = [_ffmpeg(), "-nostdin", "-hide_banner", "-loglevel", "error", "-f", "lavfi"]
        command += ["-i", f"testsrc=size={size}:rate=24", "-frames:v", str(frames)]
        command += ["-pix_fmt", "yuv420p", "-c:v", "libx264", "-preset", "ultrafast", out]
        subprocess.run(command, check=True, capture_output=True, timeout=120)
        return Path(out).read_bytes()


def imageio_frames(data: bytes) -> np.ndarray:
    """The MP4's frames as the reader before ``app.media.read`` decoded them."""
    import imageio_ffmpeg

    with tempfile.NamedTemporaryFile(suffix=".mp4") as file:
        file.write(data)
        file.flush()
        reader = imageio_ffmpeg.read_frames(file.name, pix_fmt="rgb24")
        w, h = next(reader)["size"]
        return np.stack([np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader])


def as_pixels(frames: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(frames).float().permute(3, 0, 1, 2)[None] / 127.5 - 1


@pytest.fixture(scope="module")
def clip() -> bytes:
    gen = np.random.default_rng(3)
    base = gen.integers(0, 255, (1, 64, 96, 3)).astype(np.float32)
    frames = np.clip(base + gen.normal(0, 8, (9, 64, 96, 3)), 0, 255).astype(np.uint8)
    return mp4_of(frames)


# --- a body that names another file (issue 35 item 1)


def hostile_body(kind: str, victim: Path) -> bytes:
    """A playlist, manifest or concat script naming ``victim``: absolute, or relative to the
    folder the service writes its body into (the temp folder)."""
    relative = victim.relative_to(tempfile.gettempdir()) if "rel" in kind else None
    name = str(relative or victim)
    if kind.startswith("ffconcat"):
        return f"ffconcat version 1.0\nfile '{name}'\n".encode()
    if kind.startswith("dash"):
        base = name if relative else f"file://{victim}"
        return (
            '<?xml version="1.0"?>\n<MPD xmlns="urn:mpeg:dash:schema:mpd:2011" '
            'profiles="urn:mpeg:dash:profile:isoff-on-demand:2011" type="static" '
            'mediaPresentationDuration="PT1S" minBufferTime="PT1S"><Period>'
            '<AdaptationSet mimeType="video/mp4"><Representation id="1" bandwidth="1000" '
            f'width="96" height="64"><BaseURL>{base}</BaseURL></Representation>'
            "</AdaptationSet></Period></MPD>\n"
        ).encode()
    assert kind.startswith("hls")
    return f"#EXTM3U\n#EXT-X-TARGETDURATION:2\n#EXTINF:2,\n{name}\n#EXT-X-ENDLIST\n".encode()


def assert_clean_refusal(r: requests.Response) -> None:
    """A JSON 4xx that says nothing of ffmpeg's build or of the host's files."""
    assert 400 <= r.status_code < 500, f"answered {r.status_code}: another file's latent?"
    assert r.headers["content-type"].startswith("application/json")
    text = r.text
    for leak in ("ffmpeg version", "configuration:", "--enable", tempfile.gettempdir(), "@ 0x"):
        assert leak not in text, text
    assert r.json()["error"]


@pytest.mark.parametrize("kind", ["ffconcat", "ffconcat-rel", "dash", "dash-rel", "hls", "hls-rel"])
def test_a_body_naming_another_file_is_refused(url, clip, tmp_path, kind):
    if "rel" in kind and not tmp_path.is_relative_to(tempfile.gettempdir()):
        pytest.skip("pytest's base temp folder is outside the one the service writes into")
    victim = tmp_path / "victim.mp4"
    victim.write_bytes(clip)
    body = hostile_body(kind, victim)
    r = requests.post(f"{url}/encode/ltx-tiny", data=body, headers=MP4, timeout=120)
    assert_clean_refusal(r)
    assert r.status_code == 400 and "not a readable MP4" in r.json()["error"]


def test_a_png_declared_mp4_is_refused(url):
    png = png_bytes(Image.new("RGB", (64, 64), "red"))
    r = requests.post(f"{url}/encode/ltx-tiny", data=png, headers=MP4, timeout=120)
    assert_clean_refusal(r)


def test_a_broken_mp4_error_names_no_path(url, clip):
    r = requests.post(f"{url}/encode/ltx-tiny", data=clip[: len(clip) // 2], headers=MP4)
    assert_clean_refusal(r)


@torch.inference_mode()
def test_a_real_mp4_encodes_as_before(url, store, clip):
    got = latent_of(requests.post(f"{url}/encode/ltx-tiny", data=clip, headers=MP4, timeout=120))
    want = exact_encoder(store, "ltx-tiny").encode(as_pixels(imageio_frames(clip)))
    assert got.shape == want.shape and got.shape[2] > 1
    assert cosine(got, want) >= 0.99999


def test_media_input_frames_are_imageios(clip, tmp_path):
    from app.media.read import VideoInfo, mp4_frames, probe_mp4

    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    info = probe_mp4(path, max_frames=257)
    assert info == VideoInfo(96, 64, 9)
    np.testing.assert_array_equal(np.stack(list(mp4_frames(path, info))), imageio_frames(clip))


@torch.inference_mode()
def test_the_cli_reader_refuses_a_concat_script_named_mp4(store, clip, tmp_path):
    """``python -m app encode``'s path (``encode_file``: the service's protocol and runtime)."""
    from app.cli.local_encode import LocalEncodeError, encode_file

    (tmp_path / "victim.mp4").write_bytes(clip)
    script = tmp_path / "innocent.mp4"
    script.write_text("ffconcat version 1.0\nfile 'victim.mp4'\n")  # concat's "safe" name
    out = tmp_path / "latent.safetensors"
    with pytest.raises(LocalEncodeError, match="not a readable MP4"):
        encode_file(script, "ltx-tiny", out, store)
    assert not out.exists()
    shape, _ = encode_file(tmp_path / "victim.mp4", "ltx-tiny", out, store)
    want = exact_encoder(store, "ltx-tiny").encode(as_pixels(imageio_frames(clip)))
    assert shape == tuple(want.shape) and shape[2] > 1  # the victim's 9 frames, as a body


# --- an MP4's pixels against the limits, before decoding (issue 35 item 5)


def zero_media_data(mp4: bytes) -> bytes:
    """The MP4 with its ``mdat`` payload zeroed: the index (frame count, size) intact, not
    one frame decodable."""
    out, at = bytearray(mp4), 0
    while at + 8 <= len(out):
        size, kind = struct.unpack(">I4s", out[at : at + 8])
        assert size >= 8, "a 64-bit or open-ended box: not what libx264's MP4 writes"
        if kind == b"mdat":
            out[at + 8 : at + size] = bytes(size - 8)
        at += size
    return bytes(out)


@pytest.fixture(scope="module")
def long_clip() -> bytes:
    return pattern_mp4("512x512", 257)


def test_more_frames_than_the_limit_is_refused_before_decoding(url, long_clip):
    r = requests.post(f"{url}/encode/ltx-tiny", data=long_clip, headers=MP4, timeout=120)
    assert r.status_code == 413, r.text
    assert f"more than {MAX_FRAMES} frames" in r.json()["error"]
    # before decoding (not timed: a loaded host is slow either way): with no frame of it
    # decodable, only the index can have told
    r = requests.post(f"{url}/encode/ltx-tiny", data=zero_media_data(long_clip), headers=MP4)
    assert r.status_code == 413 and f"more than {MAX_FRAMES} frames" in r.json()["error"], r.text


def test_a_frame_past_max_pixels_is_refused(url):
    r = requests.post(f"{url}/encode/ltx-tiny", data=pattern_mp4("640x480", 2), headers=MP4)
    assert r.status_code == 413, r.text
    assert f"exceeds the limit of {MAX_PIXELS} pixels" in r.json()["error"]


def test_decoding_stops_at_the_limit_and_holds_each_frame_to_the_probe(clip, tmp_path):
    from app.media.read import MediaError, VideoInfo, mp4_frames

    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    frames = mp4_frames(path, VideoInfo(96, 64, 3), max_frames=3)  # a count that lies
    assert [next(frames).shape for _ in range(3)] == [(64, 96, 3)] * 3
    with pytest.raises(MediaError, match="more than 3 frames") as info:
        next(frames)
    assert info.value.status == 413
    with pytest.raises(MediaError, match="a frame is 96x64, its stream says 32x32"):
        next(mp4_frames(path, VideoInfo(32, 32, 9)))


def test_a_decoder_that_stalls_is_ended_and_the_mp4_refused(tmp_path, monkeypatch):
    """A frame ffmpeg never delivers (a decoder deadlocked: seen once when its memory cap
    refused it a thread) would block the worker reading it, and every request behind it:
    after FRAME_TIMEOUT_S of waiting for one frame, ffmpeg is ended and the MP4 refused."""
    import imageio_ffmpeg

    from app.media import read as media_read

    pid = tmp_path / "pid"
    stalls = tmp_path / "ffmpeg"  # a frame's header and 20 of its 48 bytes, then nothing
    stalls.write_text(f"#!/bin/sh\necho $$ > {pid}\nprintf 'P6\\n4 4\\n255\\n'\n"
                      "head -c 20 /dev/zero\nexec sleep 120\n")  # fmt: skip
    stalls.chmod(0o755)
    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: str(stalls))
    monkeypatch.setattr(media_read, "FRAME_TIMEOUT_S", 0.5)
    frames = media_read.mp4_frames(tmp_path / "clip.mp4", media_read.VideoInfo(4, 4, 1))
    started = time.monotonic()
    with pytest.raises(media_read.MediaError, match="a frame took more than 0.5 s") as refused:
        next(frames)
    assert refused.value.status == 400 and time.monotonic() - started < 10
    with pytest.raises(ProcessLookupError):  # ended, and reaped
        os.kill(int(pid.read_text()), 0)


def test_a_reader_that_holds_each_frame_longer_than_the_frame_timeout_gets_them_all(
    clip, tmp_path, monkeypatch
):
    """Only the wait for a frame counts: an encoder computing on its window leaves ffmpeg
    blocked on a full pipe, and that is no stall."""
    from app.media import read as media_read

    # a limit no loaded machine's ffmpeg start comes near; the first frame held past it
    monkeypatch.setattr(media_read, "FRAME_TIMEOUT_S", 5.0)
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    got = []
    for frame in media_read.mp4_frames(path, media_read.VideoInfo(96, 64, 9)):
        got.append(frame)
        if len(got) == 1:
            time.sleep(5.5)
    np.testing.assert_array_equal(np.stack(got), imageio_frames(clip))


@pytest.mark.parametrize("read", ["image", "mp4"])
def test_running_out_of_memory_is_a_503_with_retry_after(url, clip, monkeypatch, read):
    from app.media import read as media_read

    def exhausted(*args, **kwargs):
        raise MemoryError

    name = "rgb_image" if read == "image" else "mp4_frames"
    monkeypatch.setattr(media_read, name, exhausted)
    if read == "image":
        png = png_bytes(Image.new("RGB", (64, 64)))
        r = requests.post(f"{url}/encode/flux-enc", data=png, timeout=60)
    else:
        r = requests.post(f"{url}/encode/ltx-tiny", data=clip, headers=MP4, timeout=60)
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"] == "1" and "memory" in r.json()["error"]


# --- PNG modes (issue 35 item 10)


def png_16_bit(values: np.ndarray, color_type: int) -> bytes:
    """A 16-bit PNG written by hand (Pillow writes no 16-bit RGB or grey+alpha): ``values``
    ``[H, W, C]`` uint16; colour type 0 grey, 2 RGB, 4 grey+alpha, 6 RGBA."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    h, w = values.shape[:2]
    rows = b"".join(b"\0" + row.astype(">u2").tobytes() for row in values)
    ihdr = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    body = chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def reopened(image: Image.Image) -> Image.Image:
    return Image.open(io.BytesIO(png_bytes(image)))


def palette(mode: str) -> Image.Image:
    image = Image.new(mode, (4, 4))
    image.putpalette([10, 20, 30] * 256)
    return image


GREY_16 = np.full((4, 4), 32768, np.uint16)
MODES = {  # mode -> (an image of it, the RGB it means)
    "L": (reopened(Image.new("L", (4, 4), 100)), (100, 100, 100)),
    "LA": (reopened(Image.new("LA", (4, 4), (100, 7))), (100, 100, 100)),
    "P": (reopened(palette("P")), (10, 20, 30)),
    "PA": (palette("PA"), (10, 20, 30)),  # Pillow writes no PA PNG: the mode as such
    "RGB": (reopened(Image.new("RGB", (4, 4), (1, 2, 3))), (1, 2, 3)),
    "RGBA": (reopened(Image.new("RGBA", (4, 4), (1, 2, 3, 0))), (1, 2, 3)),  # alpha dropped
    "1": (reopened(Image.new("1", (4, 4), 1)), (255, 255, 255)),
    "I;16": (reopened(Image.fromarray(GREY_16)), (128, 128, 128)),
    "I;16 white": (reopened(Image.fromarray(GREY_16 * 0 + 65535)), (255, 255, 255)),
    "I;16 100": (reopened(Image.fromarray(GREY_16 * 0 + 25700)), (100, 100, 100)),
    "I;16B": (Image.fromarray(GREY_16.astype(">u2")), (128, 128, 128)),
    "I": (Image.fromarray(GREY_16.astype(np.int32)), (128, 128, 128)),
    "I 32-bit": (Image.fromarray(np.full((4, 4), 2**31 - 1, np.int32)), (255, 255, 255)),
    "16-bit grey PNG": (Image.open(io.BytesIO(png_16_bit(GREY_16[..., None], 0))), (128,) * 3),
    "16-bit RGB PNG": (
        Image.open(io.BytesIO(png_16_bit(np.full((4, 4, 3), [32768, 25700, 65535]), 2))),
        (128, 100, 255),
    ),
    "16-bit RGBA PNG": (
        Image.open(io.BytesIO(png_16_bit(np.full((4, 4, 4), [32768, 25700, 0, 0]), 6))),
        (128, 100, 0),
    ),
    "16-bit grey+alpha PNG": (
        Image.open(io.BytesIO(png_16_bit(np.full((4, 4, 2), [25700, 0]), 4))),
        (100, 100, 100),
    ),
}


@pytest.mark.parametrize("mode", MODES)
def test_every_png_mode_reads_as_the_rgb_it_means(mode):
    from app.media.read import rgb_image

    image, rgb = MODES[mode]
    got = rgb_image(image)
    assert got.mode == "RGB" and got.size == image.size
    assert np.array_equal(np.asarray(got), np.full((4, 4, 3), rgb, np.uint8)), np.asarray(got)[0, 0]


def test_16_bit_mid_grey_is_zero_in_the_encoders_range():
    """The protocol's image reader (the service's and ``python -m app encode``'s)."""
    from app.protocol import Limits
    from app.protocol.encode import EncoderGeometry, read_image

    geo = EncoderGeometry("flux", 8, False, lambda shape: 0)
    body = png_16_bit(np.full((16, 16, 1), 32768), 0)
    x = read_image(body, "png", 8, geo, Limits())
    assert x.shape == (1, 3, 16, 16) and float(x.abs().max()) < 0.01


def grey_pair() -> tuple[bytes, bytes]:
    """A 16-bit grey PNG and the same picture in 8 bits (each 16-bit value v * 257)."""
    grey = np.random.default_rng(4).integers(0, 256, (48, 40), dtype=np.uint16)
    grey[:8] = 128  # mid grey: 32768 in 16 bits, 128 in 8
    wide = grey * 257
    wide[:8] = 32768
    return png_bytes(Image.fromarray(wide)), png_bytes(Image.fromarray(grey.astype(np.uint8)))


def test_16_bit_grey_png_encodes_as_its_8_bit_twin_over_http(url):
    wide, narrow = grey_pair()
    assert Image.open(io.BytesIO(wide)).mode == "I;16"
    got = latent_of(requests.post(f"{url}/encode/flux-enc", data=wide, timeout=60))
    want = latent_of(requests.post(f"{url}/encode/flux-enc", data=narrow, timeout=60))
    assert torch.equal(got, want)


def test_16_bit_grey_png_in_the_cli_reader(store, tmp_path):
    """``python -m app encode``'s path: the 16-bit PNG encodes as its 8-bit twin."""
    from safetensors.torch import load_file

    from app.cli.local_encode import encode_file

    wide, narrow = grey_pair()
    (tmp_path / "wide.png").write_bytes(wide)
    (tmp_path / "narrow.png").write_bytes(narrow)
    for name in ("wide", "narrow"):
        encode_file(tmp_path / f"{name}.png", "flux-enc", tmp_path / f"{name}.safetensors", store)
    got = load_file(str(tmp_path / "wide.safetensors"))["latent"]
    want = load_file(str(tmp_path / "narrow.safetensors"))["latent"]
    assert got.shape == (1, 16, 6, 5) and torch.equal(got, want)


def test_ffmpegs_last_line_loses_addresses_and_paths(tmp_path):
    from app.media.read import _last_line

    body = tmp_path / "body.mp4"
    log = f"[in#0 @ 0x55d4be23cd00] Opening 'file:{body}'\n[dec:h264 @ 0x55b5f1265280] "
    log += f"Error reading file:{body} and /etc/passwd: ratio 1/2\n\n"
    with tempfile.TemporaryFile() as file:
        file.write(log.encode())
        assert _last_line(file, body) == "Error reading <file> and <file> ratio 1/2"


def claiming(mp4: bytes, samples: int) -> bytes:
    """The MP4 with its sample tables claiming ``samples`` samples of one size in one chunk
    (``stsz`` sample_size and count, one ``stsc`` entry): a few KB whose index, built as the
    file opens (24 bytes a sample in ffmpeg's mov demuxer), would be ``samples`` entries."""
    out, containers = bytearray(mp4), {b"moov", b"trak", b"mdia", b"minf", b"stbl"}

    def walk(at: int, end: int) -> None:
        while at + 8 <= end:
            size, kind = struct.unpack(">I4s", out[at : at + 8])
            if kind in containers:
                walk(at + 8, at + size)
            elif kind == b"stsz":
                struct.pack_into(">II", out, at + 12, 100, samples)
            elif kind == b"stsc":
                struct.pack_into(">IIII", out, at + 12, 1, 1, samples, 1)
            at += size

    walk(0, len(out))
    return bytes(out)


PROBE_PEAK = """
import resource, sys
from pathlib import Path
from app.media.read import MediaError, mp4_frames, probe_mp4
try:
    path = Path(sys.argv[1])
    info = probe_mp4(path, max_frames=257, max_pixels=2048 * 2048)
    list(mp4_frames(path, info, max_frames=257))
    print("read", info)
except MediaError as exc:
    print("refused", exc.status)
print("peak", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss << 10)
"""


def test_an_mp4_claiming_millions_of_samples_costs_ffmpeg_no_more_memory(clip, tmp_path):
    """A 3 KB container's index is bounded (ffmpeg's -max_alloc): 20 million claimed samples
    made ffmpeg allocate 1.2 GB as it opened the file (80 million: 4.1 GB); what a real clip
    needs is a few tens of MB. Refused as a broken MP4, or read as no frames."""
    import sys

    peaks = {}
    for name, body in (("real", clip), ("claiming", claiming(clip, 20_000_000))):
        path = tmp_path / f"{name}.mp4"
        path.write_bytes(body)
        run = subprocess.run([sys.executable, "-c", PROBE_PEAK, str(path)], capture_output=True,
                             text=True, timeout=120, cwd=Path(__file__).parent.parent)  # fmt: skip
        lines = run.stdout.splitlines()
        assert run.returncode == 0 and lines, run.stderr[-2000:]
        peaks[name] = int(lines[-1].split()[1])
        if name == "claiming":
            assert lines[0] in ("refused 400", "read VideoInfo(width=96, height=64, frames=0)")
    assert peaks["claiming"] < peaks["real"] + (128 << 20), peaks


def test_a_jpeg_of_thousands_of_scans_is_refused_before_decoding(url):
    """Each scan of a progressive JPEG is a pass over the whole image: one scan repeated
    makes a body whose decode costs CPU without bound. An encoder's progressive JPEG (about
    ten scans) is read as ever."""
    image = Image.fromarray(np.random.default_rng(5).integers(0, 255, (64, 64, 3), np.uint8))
    buf = io.BytesIO()
    image.save(buf, "JPEG", progressive=True, quality=90)
    jpeg = buf.getvalue()
    jpeg_type = {"Content-Type": "image/jpeg"}
    ok = requests.post(f"{url}/encode/flux-enc", data=jpeg, headers=jpeg_type, timeout=60)
    assert ok.status_code == 200, ok.text
    last = jpeg.rindex(b"\xff\xda")  # the last scan, up to the end of image
    bomb = jpeg[:last] + jpeg[last:-2] * 5000 + b"\xff\xd9"
    r = requests.post(f"{url}/encode/flux-enc", data=bomb, headers=jpeg_type, timeout=60)
    assert r.status_code == 422, r.text
    assert "scans" in r.json()["error"] and "at most" in r.json()["expected"]


def with_tracks(mp4: bytes, count: int) -> bytes:
    """The MP4 with its one track ``count`` times (ids 1..count), in a ``moov`` that ends the
    file as imageio's writer puts it (no chunk offset moves)."""
    at = 0
    while mp4[at + 4 : at + 8] != b"moov":
        at += struct.unpack(">I", mp4[at : at + 4])[0]
    end = at + struct.unpack(">I", mp4[at : at + 4])[0]
    assert end == len(mp4), "a moov before the media data: its chunk offsets would move"
    boxes, i = b"", at + 8
    while i < end:
        size, kind = struct.unpack(">I4s", mp4[i : i + 8])
        boxes += mp4[i : i + size]
        for track in range(2, count + 1 if kind == b"trak" else 0):
            copy = bytearray(mp4[i : i + size])
            tkhd = copy.index(b"tkhd") - 4  # its track id: after version 0's 32-bit times
            struct.pack_into(">I", copy, tkhd + (20 if copy[tkhd + 8] == 0 else 28), track)
            boxes += copy
        i += size
    return mp4[:at] + struct.pack(">I4s", len(boxes) + 8, b"moov") + boxes


PEAK = """import resource, subprocess, sys
code = subprocess.call(sys.argv[2:])
with open(sys.argv[1], "a") as peaks:
    print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss << 10, file=peaks)
sys.exit(code)
"""


@pytest.fixture
def ffmpeg_peaks(tmp_path, monkeypatch) -> Callable[[], list[int]]:
    """Every ffmpeg run's peak resident set (bytes), from a small Python parent of its own:
    the maxrss of a child pytest forks starts at pytest's own size."""
    import imageio_ffmpeg

    (tmp_path / "peak.py").write_text(PEAK)
    peaks, exe = tmp_path / "peaks", tmp_path / "ffmpeg"
    args = [sys.executable, "-I", "-S", str(tmp_path / "peak.py"), str(peaks)]
    exe.write_text(f'#!/bin/sh\nexec {shlex.join([*args, _ffmpeg()])} "$@"\n')
    exe.chmod(0o755)
    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: str(exe))
    return lambda: [int(n) for n in peaks.read_text().split()] if peaks.exists() else []


@pytest.mark.parametrize("tracks, samples", [(1, 20_000_000), (16, 2_500_000)])
def test_an_mp4_claiming_millions_of_samples_keeps_ffmpeg_bounded(
    clip, ffmpeg_peaks, tracks, samples
):
    """ffmpeg's mov demuxer indexes every sample a file claims (24 bytes each) as it opens it:
    one track claiming 20 million took 1.2 GB. -max_alloc refuses that one allocation, not
    16 tracks of 2.5 million (60 MB each): 1 GB. The service's reader refuses both (4xx),
    each ffmpeg run within its memory bound (RLIMIT_DATA: 128 MiB probing)."""
    from app.media.read import MediaError, Mp4Clip

    body = with_tracks(claiming(clip, samples), tracks)
    with pytest.raises(MediaError) as refused:
        Mp4Clip(body, max_frames=MAX_FRAMES, max_pixels=MAX_PIXELS, multiple=8).close()
    assert refused.value.status in (400, 413), refused.value.message
    peaks = ffmpeg_peaks()
    assert peaks and max(peaks) < 300 << 20, peaks


def scan_bomb(repeats: int) -> bytes:
    """A 64x64 progressive JPEG (Pillow's: about ten scans) with its last scan repeated."""
    image = Image.fromarray(np.random.default_rng(5).integers(0, 255, (64, 64, 3), np.uint8))
    buf = io.BytesIO()
    image.save(buf, "JPEG", progressive=True, quality=90)
    jpeg = buf.getvalue()
    return jpeg[:-2] + jpeg[jpeg.rindex(b"\xff\xda") : -2] * repeats + b"\xff\xd9"


def test_rgb_image_refuses_a_jpeg_past_the_scan_limit_before_decoding(monkeypatch):
    from PIL import JpegImagePlugin

    from app.media.read import MAX_JPEG_SCANS, MediaError, rgb_image

    scans = scan_bomb(0).count(b"\xff\xda")
    at_limit = Image.open(io.BytesIO(scan_bomb(MAX_JPEG_SCANS - scans)))
    assert rgb_image(at_limit).size == (64, 64)
    past = Image.open(io.BytesIO(scan_bomb(MAX_JPEG_SCANS - scans + 1)))

    def decoded(*args, **kwargs):
        raise AssertionError("the JPEG was decoded")

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "load", decoded)
    with pytest.raises(MediaError, match=f"more than {MAX_JPEG_SCANS} scans") as refused:
        rgb_image(past)
    assert refused.value.status == 422


@pytest.mark.parametrize("declared", ["image/png", "image/webp"])
def test_a_jpeg_of_thousands_of_scans_declared_another_type_is_refused(url, declared):
    """Pillow opens a JPEG whatever the Content-Type said: the scan limit holds for it too."""
    from app.media.read import MAX_JPEG_SCANS

    r = requests.post(
        f"{url}/encode/flux-enc",
        data=scan_bomb(5000),
        headers={"Content-Type": declared},
        timeout=60,
    )
    assert 400 <= r.status_code < 500, r.text
    assert f"more than {MAX_JPEG_SCANS} scans (the limit)" in r.json()["error"]


# --- clips as phones and editors write them: variable frame rates, edit lists


def ffmpeg_mp4(folder: Path, name: str, *args: str) -> Path:
    """``ffmpeg ARGS`` writing ``folder/name`` (the binary the service runs)."""
    out = folder / name
    command = [_ffmpeg(), "-nostdin", "-hide_banner", "-loglevel", "error", "-y", *args, str(out)]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return out


def clip_frames(body: bytes) -> torch.Tensor:
    """Every frame the service's reader gives an encoder, ``[1, 3, T, H, W]``."""
    from app.media.read import Mp4Clip

    clip = Mp4Clip(body, max_frames=257, max_pixels=MAX_PIXELS, multiple=8)  # the default
    try:
        return clip.window(0, clip.shape[2])
    finally:
        clip.close()


def test_a_variable_frame_rate_clip_gives_each_of_its_frames_once(tmp_path):
    """9 flat frames of rising grey, 2/8 s apart, then 7/8 s: each frame once, in order (a
    constant-rate read repeated the first four and never reached the last five)."""
    greys = np.linspace(16, 235, 9).astype(np.uint8)
    frames = np.broadcast_to(greys[:, None, None, None], (9, 64, 64, 3)).copy()
    raw = tmp_path / "frames.rgb"
    raw.write_bytes(frames.tobytes())
    args = ["-f", "rawvideo", "-pix_fmt", "rgb24", "-s", "64x64", "-r", "8", "-i", str(raw)]
    args += ["-vf", "setpts='if(lt(N,4),N*2,N*7)/TB/8'", "-fps_mode", "passthrough"]
    args += ["-c:v", "libx264", "-qp", "0", "-pix_fmt", "yuv444p"]
    body = ffmpeg_mp4(tmp_path, "vfr.mp4", *args).read_bytes()
    read = clip_frames(body)
    means = (read.mean(dim=(0, 1, 3, 4)) + 1) * 127.5
    assert read.shape[2] == 9 and np.allclose(means.numpy(), greys, atol=2), means


def test_a_clip_trimmed_by_an_edit_list_reads_the_frames_it_shows(tmp_path):
    """A lossless cut (``-ss 1 -c copy``: what phones' and editors' trims write) keeps the
    packets from the keyframe before the cut, which the edit list hides: the reader counts
    and gives the 33 shown frames, as a player (and imageio) does, not 41 packets."""
    args = ["-f", "lavfi", "-i", "testsrc2=size=64x64:rate=8", "-frames:v", "41"]
    long = ffmpeg_mp4(tmp_path, "long.mp4", *args, "-c:v", "libx264", "-g", "40")
    cut = ffmpeg_mp4(tmp_path, "cut.mp4", "-ss", "1.0", "-i", str(long), "-c", "copy")
    body = cut.read_bytes()
    shown = imageio_frames(body)
    read = clip_frames(body)
    assert read.shape[2] == len(shown) == 33
    assert torch.equal(read, as_pixels(shown))
