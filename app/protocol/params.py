"""Query params -> ``DecodeParams``: remote_decode's names and meanings, strictly parsed.

An unknown name is refused (a misspelled ``image_fromat`` must not pass silently); the
accepted names are every one diffusers' ``remote_decode`` sends (and its older releases'
``*_tensor_type``/``return_type``), plus this service's own. Numbers are ASCII only:
``int``/``float`` would read Unicode digits (``shape=٤``) and ``1_000``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from app.protocol.errors import ProtocolError, echo

WIRE_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "float32": (torch.float32, 4),
    "float16": (torch.float16, 2),
    "bfloat16": (torch.bfloat16, 2),
}
IMAGE_FORMATS = ("png", "jpg", "webp")
MAX_DIM = 1 << 20

# what diffusers' remote_decode sends (0.42: prepare_decode), and older releases' extra names
REMOTE_DECODE_PARAMS = (
    "shape",
    "dtype",
    "output_type",
    "image_format",
    "partial_postprocess",
    "scaling_factor",
    "shift_factor",
    "do_scaling",
    "height",
    "width",
    "input_tensor_type",
    "output_tensor_type",
    "return_type",
)
SERVICE_PARAMS = ("fps", "timestep", "seed", "quality", "model", "timeout", "frame")
OUTPUT_TYPES = ("pil", "pt", "mp4", "preview")
DECODE_PARAMS = frozenset(REMOTE_DECODE_PARAMS + SERVICE_PARAMS)
# what remote_encode sends (0.42: prepare_encode), and the encoder's own: for an encode route
ENCODE_PARAMS = frozenset(
    (
        *("shape", "dtype", "scaling_factor", "shift_factor"),
        *("do_scaling", "sample", "seed", "packed", "model", "timeout"),
    )
)

_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(
    r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?i:nan|inf|infinity)"
)


@dataclass(frozen=True)
class DecodeParams:
    """The query params, parsed: same names and meanings as remote_decode's."""

    shape: tuple[int, ...] | None = None
    dtype: str = "float32"
    output_type: str = "pil"
    output_type_given: bool = False  # an explicit output_type wins over Accept
    image_format: str | None = None
    partial_postprocess: bool = False
    scaling_factor: float | None = None
    shift_factor: float | None = None
    do_scaling: bool = False
    height: int | None = None
    width: int | None = None
    fps: float | None = None
    timestep: float | None = None
    seed: int | None = None
    quality: int = 90
    model: str | None = None
    timeout: float | None = None  # seconds the caller waits; the server caps it
    frame: int | None = None  # output_type=preview of a video latent: which latent frame

    def options(self) -> dict[str, Any]:
        """The family knobs a decode takes (LTX timestep conditioning and noise seed)."""
        pairs = (("timestep", self.timestep), ("seed", self.seed))
        return {k: v for k, v in pairs if v is not None}


def parse_params(
    items: list[tuple[str, str]], accepted: frozenset[str] = DECODE_PARAMS
) -> DecodeParams:
    """Query items (repeated keys kept) -> ``DecodeParams``, or a 422 naming the param."""
    multi: dict[str, list[str]] = {}
    for key, value in items:
        multi.setdefault(key, []).append(value)
    unknown = sorted(k for k in multi if k not in accepted)
    if unknown:
        names = ", ".join(echo(k, 40) for k in unknown[:8])
        raise ProtocolError(
            422, f"unknown query parameter {names}", "one of " + ", ".join(sorted(accepted))
        )

    def one(key: str) -> str | None:
        return multi[key][-1] if key in multi else None

    dtype = one("dtype") or "float32"
    if dtype not in WIRE_DTYPES:  # exact: remote_decode sends torch's lower-case names
        raise ProtocolError(422, f"dtype {echo(dtype)} is not supported", "|".join(WIRE_DTYPES))
    output_type = (one("output_type") or "pil").lower()
    if output_type not in OUTPUT_TYPES:
        raise ProtocolError(
            422, f"output_type {echo(output_type)} is not supported", "|".join(OUTPUT_TYPES)
        )
    fmt = one("image_format")
    if fmt is not None:
        fmt = {"jpeg": "jpg"}.get(fmt.lower(), fmt.lower())
        if fmt not in IMAGE_FORMATS:
            raise ProtocolError(422, f"image_format {echo(fmt)} is not supported", "png|jpg|webp")
    scaling_factor = _number("scaling_factor", one("scaling_factor"), float)
    shift_factor = _number("shift_factor", one("shift_factor"), float)
    _check_factors_in_float32(scaling_factor, shift_factor)
    return DecodeParams(
        shape=_parse_shape(multi["shape"]) if "shape" in multi else None,
        dtype=dtype,
        output_type=output_type,
        output_type_given=one("output_type") is not None,
        image_format=fmt,
        partial_postprocess=_bool("partial_postprocess", one("partial_postprocess")),
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        do_scaling=_bool("do_scaling", one("do_scaling")),
        height=_number("height", one("height"), int, low=1, high=MAX_DIM),
        width=_number("width", one("width"), int, low=1, high=MAX_DIM),
        fps=_number("fps", one("fps"), float, low=0.1, high=240),
        timestep=_number("timestep", one("timestep"), float, low=0, high=1000),
        seed=_number("seed", one("seed"), int, low=0, high=2**63 - 1),
        quality=_number("quality", one("quality"), int, low=1, high=100) or 90,
        model=one("model"),
        timeout=parse_timeout("timeout", one("timeout")),
        frame=_number("frame", one("frame"), int, low=-MAX_DIM, high=MAX_DIM),
    )


def parse_timeout(name: str, value: str | None) -> float | None:
    """A deadline in seconds (``timeout`` param or ``X-Request-Timeout`` header), > 0."""
    seconds = _number(name, value, float)
    if seconds is not None and seconds <= 0:
        raise ProtocolError(422, f"{name}={echo(value)} must be positive", "seconds > 0")
    return seconds


def _parse_shape(values: list[str]) -> tuple[int, ...]:
    text = values[0].strip() if len(values) == 1 else None
    try:
        if text is not None and text.startswith("["):
            dims = json.loads(text)
            if not isinstance(dims, list) or not all(type(d) is int for d in dims):
                raise ValueError
        else:
            parts = text.split(",") if text is not None and "," in text else values
            dims = [_ascii_int(v) for v in parts]
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise ProtocolError(
            422,
            f"shape {echo(values)} is not a list of integers",
            "shape=1&shape=16&shape=64&shape=64 or shape=[1,16,64,64]",
        ) from None
    if not 2 <= len(dims) <= 5 or any(d < 1 or d > MAX_DIM for d in dims):
        raise ProtocolError(
            422, f"shape {echo(dims)} is out of range", f"2 to 5 dims, each 1..{MAX_DIM}"
        )
    return tuple(dims)


def _ascii_int(text: str) -> int:
    if not _INT.fullmatch(text.strip()):
        raise ValueError(text)
    return int(text)


def _bool(name: str, value: str | None) -> bool:
    if value is None:
        return False
    try:
        return _BOOL[value.strip().lower()]
    except KeyError:
        raise ProtocolError(
            422, f"{name}={echo(value)} is not a boolean", "true|false|1|0"
        ) from None


def _number(
    name: str, value: str | None, kind: type, low: float | None = None, high: float | None = None
) -> Any:
    if value is None or value == "":
        return None
    pattern = _INT if kind is int else _FLOAT
    if not pattern.fullmatch(value.strip()):
        what = "an integer" if kind is int else "a number"
        raise ProtocolError(422, f"{name}={echo(value)} is not {what}", f"{what} in ASCII digits")
    try:
        number = kind(value)
    except (ValueError, OverflowError):  # float("1e999") is inf; int never fails here
        number = math.inf
    if (
        # an int is finite, and compared exactly: math.isfinite(10**400) raises OverflowError
        (kind is not int and not math.isfinite(number))
        or (low is not None and number < low)
        or (high is not None and number > high)
    ):
        raise ProtocolError(422, f"{name}={echo(value)} is out of range", _range(low, high))
    return number


def _range(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f"{low:g}..{high:g}"
    if low is not None:
        return f"a finite number >= {low:g}"
    if high is not None:
        return f"a finite number <= {high:g}"
    return "a finite number"


def _check_factors_in_float32(scaling: float | None, shift: float | None) -> None:
    """The decode divides and shifts in float32: a factor that is 0 or infinite there (1e-50,
    1e39) would turn every pixel into NaN, however finite it is as a Python float."""
    with np.errstate(all="ignore"):
        scale = np.float32(scaling if scaling is not None else 1.0)
        scale_ok = scale != 0 and np.isfinite(scale) and np.isfinite(np.float32(1) / scale)
        shift_ok = np.isfinite(np.float32(shift or 0.0))
    if not scale_ok:
        raise ProtocolError(
            422,
            f"scaling_factor={scaling!r} is 0 or infinite (or so is its inverse) in float32",
            "a non-zero number with it and 1/scaling_factor within float32's range",
        )
    if not shift_ok:
        raise ProtocolError(
            422, f"shift_factor={shift!r} overflows float32", "|shift_factor| < 3.4e38"
        )
