"""PNG encoding: fpng (``fpng`` on PyPI, the py-fpng-nb binding of Rich Geldreich's fpng)
when its wheel is installed, else Pillow at compression level 1.

fpng is a PNG writer built for speed (SIMD filtering and a deflate tuned for images): about
ten times faster than zlib-based writers for the same size, lossless, read by any PNG decoder.
Where no wheel exists for the platform, Pillow (always installed) writes the PNG instead.
Measurements: docs/BENCHMARKS.md, "PNG encoding" (``python -m bench png``).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)
Encoder = Callable[[np.ndarray], bytes]


def _fpng() -> Encoder:
    import fpng

    def encode(rgb: np.ndarray) -> bytes:
        return fpng.from_ndarray(np.ascontiguousarray(rgb))

    return encode


def _pillow() -> Encoder:
    def encode(rgb: np.ndarray) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(rgb), "RGB").save(buf, "PNG", compress_level=1)
        return buf.getvalue()

    return encode


# in order of preference; each loader raises ImportError when its library is missing
BACKENDS: dict[str, Callable[[], Encoder]] = {"fpng": _fpng, "pillow": _pillow}


def select_backend() -> tuple[str, Encoder]:
    """The first backend whose library imports."""
    for name, load in BACKENDS.items():
        try:
            return name, load()
        except ImportError as exc:
            log.info("PNG backend %s unavailable (%s); trying the next", name, exc)
    raise RuntimeError("no PNG backend")  # unreachable: Pillow is a dependency


BACKEND, _encode = select_backend()


def encode_png(rgb: np.ndarray) -> bytes:
    """uint8 ``[H, W, 3]`` -> PNG bytes (8-bit RGB, no interlace), lossless."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected uint8 [H, W, 3], got {rgb.dtype} {list(rgb.shape)}")
    return _encode(rgb)
