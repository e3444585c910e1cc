"""MP4 encoding through imageio-ffmpeg's ffmpeg, checked by decoding the result back."""

from __future__ import annotations

import os
import re
import subprocess

import imageio_ffmpeg
import numpy as np
import pytest
import torch

from app.families.ltx import decoder as ltx
from app.media import mp4


def gradient_frames(n: int, h: int, w: int) -> list[np.ndarray]:
    """Smooth moving gradients: content H.264 keeps close to the source."""
    y, x = np.mgrid[0:h, 0:w]
    return [
        np.stack([(x * 4 + i * 8) % 256, (y * 4) % 256, np.full_like(x, 128 + i)], -1).astype(
            np.uint8
        )
        for i in range(n)
    ]


def write(tmp_path, chunks) -> str:
    path = tmp_path / "out.mp4"
    path.write_bytes(b"".join(chunks))
    return str(path)


def read_back(path: str) -> tuple[dict, list[np.ndarray]]:
    reader = imageio_ffmpeg.read_frames(path)
    meta = next(reader)
    w, h = meta["size"]
    return meta, [np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader]


def probe(path: str) -> str:
    """What ``ffmpeg -i`` says about the file (the ffprobe of imageio-ffmpeg's binary)."""
    exe = imageio_ffmpeg.get_ffmpeg_exe()
    return subprocess.run([exe, "-hide_banner", "-i", path], capture_output=True, text=True).stderr


def test_roundtrip_count_size_fps(tmp_path):
    frames = gradient_frames(17, 48, 64)
    path = write(tmp_path, mp4.encode_mp4(iter(frames), fps=25))
    meta, got = read_back(path)
    assert len(got) == 17 and meta["size"] == (64, 48) and meta["fps"] == 25
    assert np.abs(got[8].astype(int) - frames[8]).mean() < 3
    info = probe(path)
    assert re.search(r"Video: h264 .*yuv420p.*64x48.*25 fps", info), info


def test_odd_size_is_padded_with_edge_pixels(tmp_path):
    frames = gradient_frames(3, 47, 33)
    meta, got = read_back(write(tmp_path, mp4.encode_mp4(frames, fps=24)))
    assert meta["size"] == (34, 48) and len(got) == 3
    assert np.abs(got[1][:47, :33].astype(int) - frames[1]).mean() < 3
    padded = mp4.even_frame(frames[1])
    assert (padded[-1] == padded[-2]).all() and (padded[:, -1] == padded[:, -2]).all()


def test_streams_while_frames_arrive():
    pulled = 0

    def source():
        nonlocal pulled
        for frame in gradient_frames(60, 32, 32):
            pulled += 1
            yield frame

    encoder = mp4.encode_mp4(source(), fps=10)  # a keyframe (fragment) every 20 frames
    first = next(encoder)
    assert first[4:8] == b"ftyp" and pulled < 60  # the header left before the last frame
    rest = b"".join(encoder)
    assert b"moof" in rest and pulled == 60


def test_bad_input():
    with pytest.raises(ValueError, match="no frames"):
        list(mp4.encode_mp4(iter([]), fps=24))
    with pytest.raises(ValueError, match="uint8"):
        list(mp4.encode_mp4([np.zeros((8, 8, 3), np.float32)], fps=24))
    with pytest.raises(ValueError, match="size changed"):
        list(mp4.encode_mp4([np.zeros((8, 8, 3), np.uint8), np.zeros((8, 10, 3), np.uint8)]))


def test_chunk_to_uint8():
    chunk = (
        torch.tensor([0.0, 0.5, 1.0, 1.5, -0.2, 0.002]).view(1, 1, 1, 1, 6).expand(2, 3, 2, 1, 6)
    )
    frames = mp4.to_uint8(chunk)
    assert frames.shape == (2, 2, 1, 6, 3) and frames.dtype == np.uint8
    assert frames[0, 0, 0, :, 0].tolist() == [0, 128, 255, 255, 0, 1]
    assert len(list(mp4.iter_frames([chunk, chunk], batch_index=1))) == 4


def test_ltx_decode_to_mp4(tmp_path):
    """The streaming path end to end: iter_decode -> [0,1] -> uint8 frames -> MP4."""
    decoder = ltx.Decoder(ltx.SYNTHETIC["ltx-tiny"]).eval()
    ltx.init_synthetic(decoder, torch.Generator().manual_seed(0))
    z = torch.randn((1, 128, 3, 2, 3), generator=torch.Generator().manual_seed(1))
    chunks = (decoder.to_unit(c) for c in decoder.iter_decode(z, chunk_frames=1))
    path = write(tmp_path, mp4.encode_mp4(mp4.iter_frames(chunks), fps=25))
    meta, got = read_back(path)
    expected = mp4.to_uint8(decoder.to_unit(decoder.decode(z)))[0]
    assert len(got) == decoder.frames_out(3) == 17
    assert meta["size"] == (96, 64) and meta["fps"] == 25
    # synthetic weights give per-pixel colour noise, which yuv420p's 2x2 chroma cannot hold:
    # compare luma (the measured error is about 5 of 255 at crf 18, 1.3 at crf 0)
    err = np.abs(luma(np.stack(got)) - luma(expected)).mean()
    print(f"mp4 vs decoded uint8 frames: mean abs luma error {err:.2f}")
    assert err < 8


def luma(frames: np.ndarray) -> np.ndarray:
    return frames.astype(np.float64) @ np.array([0.299, 0.587, 0.114])


def noise_frames(n: int, size: int):
    rng = np.random.default_rng(0)
    for _ in range(n):
        yield rng.integers(0, 255, (size, size, 3), dtype=np.uint8)


def encoder_threads(threads: int | None) -> tuple[int, list[str]]:
    """The most threads ffmpeg ran while encoding noise, and its command line."""
    procs, seen = [], []

    def frames():
        for i, frame in enumerate(noise_frames(40, 256)):
            if procs and i % 8 == 4:
                status = open(f"/proc/{procs[0].pid}/status").read()
                seen.append(int(status.split("Threads:")[1].split()[0]))
            yield frame

    for _ in mp4.encode_mp4(frames(), 24, threads=threads, started=procs.append):
        pass
    return max(seen), procs[0].args


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux /proc")
def test_encoder_threads_are_bounded():
    bounded, args = encoder_threads(1)
    assert args[args.index("-threads") + 1] == "1"
    default, args = encoder_threads(None)
    assert "-threads" not in args
    assert bounded < default  # libx264's default is 1.5 threads a core (and lookahead ones)


def test_reap_ends_an_encoder_blocked_in_another_thread():
    """The generator is suspended (its reader went away): reap kills and collects ffmpeg at
    once from here, and closing the generator afterwards still frees its pipes."""
    procs = []
    encoder = mp4.encode_mp4(noise_frames(200, 128), 24, started=procs.append)
    next(encoder)
    proc = procs[0]
    assert proc.poll() is None
    mp4.reap(proc)
    assert proc.returncode is not None  # collected: no zombie left
    encoder.close()
    assert proc.stdin.closed and proc.stdout.closed
