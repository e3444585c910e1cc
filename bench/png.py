"""PNG encoders for one decoded image: time, size and an exact round trip per candidate.

    python -m bench png [--size 1024] [--repeats 15]

The image is the shared test photograph (../shared/data/astronaut.png, else a seeded smooth
field with noise) resized to SIZE x SIZE RGB: a decoded image's statistics, not noise. Each
candidate encodes it REPEATS times (median, after one warm-up); its output is decoded with
Pillow and must equal the input byte for byte. A candidate whose module is missing is listed
as such. The table goes to docs/BENCHMARKS.md, "PNG encoding".
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from bench.common import machine

SHARED_IMAGE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "astronaut.png"


def test_image(size: int) -> np.ndarray:
    if SHARED_IMAGE.exists():
        photo = Image.open(SHARED_IMAGE).convert("RGB")
        return np.asarray(photo.resize((size, size), Image.Resampling.LANCZOS))
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size] / size
    field = np.stack([np.sin(6 * x + 2 * y), np.cos(5 * y - x), np.sin(3 * (x + y))], -1)
    noisy = 127.5 + 100 * field + rng.normal(0, 6, field.shape)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def _pillow(level: int) -> Callable[[np.ndarray], bytes]:
    def encode(rgb: np.ndarray) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(rgb, "RGB").save(buf, format="PNG", compress_level=level)
        return buf.getvalue()

    return encode


def _opencv(level: int) -> Callable[[np.ndarray], bytes]:
    import cv2

    def encode(rgb: np.ndarray) -> bytes:
        ok, out = cv2.imencode(".png", rgb[..., ::-1], [cv2.IMWRITE_PNG_COMPRESSION, level])
        assert ok
        return out.tobytes()

    return encode


def _fpng() -> Callable[[np.ndarray], bytes]:
    import fpng

    return lambda rgb: fpng.from_ndarray(np.ascontiguousarray(rgb))


def _vips(level: int) -> Callable[[np.ndarray], bytes]:
    import pyvips

    def encode(rgb: np.ndarray) -> bytes:
        h, w, c = rgb.shape
        image = pyvips.Image.new_from_memory(np.ascontiguousarray(rgb).data, w, h, c, "uchar")
        return image.pngsave_buffer(compression=level, filter=pyvips.ForeignPngFilter.SUB)

    return encode


def _zlib_ng(level: int) -> Callable[[np.ndarray], bytes]:
    """PNG's Sub filter in numpy, then one zlib-ng stream (python-zlib-ng)."""
    import struct
    import zlib

    from zlib_ng import zlib_ng

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    def encode(rgb: np.ndarray) -> bytes:
        h, w, _ = rgb.shape
        rows = np.ascontiguousarray(rgb).reshape(h, -1)
        out = np.empty((h, rows.shape[1] + 1), np.uint8)
        out[:, 0], out[:, 1:4] = 1, rows[:, :3]
        np.subtract(rows[:, 3:], rows[:, :-3], out=out[:, 4:])
        header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
        idat = zlib_ng.compress(out.tobytes(), level)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat)
                + chunk(b"IEND", b""))  # fmt: skip

    return encode


def _service() -> Callable[[np.ndarray], bytes]:
    from app.media.png import encode_png

    return encode_png


def _app_backend(name: str) -> Callable[[], Callable[[np.ndarray], bytes]]:
    def load() -> Callable[[np.ndarray], bytes]:
        from app.media import png

        return png.BACKENDS[name]()

    return load


def candidates() -> dict[str, Callable[[], Callable[[np.ndarray], bytes]]]:
    """name -> a loader of its encoder (a loader raises ImportError when its module is missing)."""
    out: dict[str, Callable[[], Callable[[np.ndarray], bytes]]] = {
        "app.media.png.encode_png (the service's choice)": _service,
        "fpng (py-fpng-nb)": _fpng,
        "zlib-ng level 1 (Sub filter, one stream)": lambda: _zlib_ng(1),
        "OpenCV imencode, level 1": lambda: _opencv(1),
        "libvips pngsave, level 1, Sub filter": lambda: _vips(1),
        "Pillow, level 1": lambda: _pillow(1),
        "Pillow, level 6 (its default)": lambda: _pillow(6),
    }
    try:
        from app.media import png

        for name in png.BACKENDS:
            out[f"app.media.png backend {name!r}"] = _app_backend(name)
    except (ImportError, AttributeError):
        pass
    return out


def measure(rgb: np.ndarray, encode: Callable[[np.ndarray], bytes], repeats: int):
    out = encode(rgb)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = encode(rgb)
        times.append(time.perf_counter() - start)
    exact = np.array_equal(np.asarray(Image.open(io.BytesIO(out)).convert("RGB")), rgb)
    return statistics.median(times) * 1e3, len(out), exact


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)


def run(args: argparse.Namespace) -> None:
    rgb = test_image(args.size)
    print(f"{machine()}; {os.cpu_count()} cores; {args.size}x{args.size} RGB")
    print("| encoder | ms (median) | bytes | round trip |")
    print("|---|---|---|---|")
    for name, load in candidates().items():
        try:
            encode = load()
        except ImportError as exc:
            print(f"| {name} | not installed ({exc.name}) | | |")
            continue
        ms, size, exact = measure(rgb, encode, args.repeats)
        print(f"| {name} | {ms:.1f} | {size:,} | {'exact' if exact else 'DIFFERS'} |")
