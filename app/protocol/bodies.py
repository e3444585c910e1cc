"""Request bodies -> tensors: raw remote_decode bytes, safetensors, ``.npy``.

Every parser checks what a body declares against what it holds before allocating anything
sized by the request.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import torch
from torch import Tensor

from app.protocol.errors import ProtocolError, echo, plain
from app.protocol.params import MAX_DIM, WIRE_DTYPES, DecodeParams

RAW_TYPES = {"tensor/binary", "application/octet-stream"}
SAFETENSORS_TYPE = "application/x-safetensors"
NPY_TYPE = "application/x-npy"
NPY_HEADER_MOST = 1 << 16  # numpy's own parser refuses headers past 10,000 bytes
IDENTITY_ENCODINGS = {"", "identity"}


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def check_content_encoding(values: list[str]) -> None:
    """Bodies are read as sent: a compressed one would be parsed as garbage, so refuse it.
    Repeated headers are one comma-separated list (RFC 9110 5.3): ``identity`` then ``gzip``
    is gzip."""
    codings = [c.strip().lower() for v in values for c in v.split(",")]
    if any(c not in IDENTITY_ENCODINGS for c in codings):
        raise ProtocolError(
            415,
            f"Content-Encoding {echo(', '.join(values))} is not supported",
            "an uncompressed body (no Content-Encoding, or identity)",
        )


def parse_body(content_type: str | None, body: bytes, params: DecodeParams) -> Tensor:
    """The request body -> a float tensor in the wire's dtype (then checked by ``validate``)."""
    kind = media_type(content_type) or "tensor/binary"
    if kind in RAW_TYPES:
        return _parse_raw(body, params)
    if kind == SAFETENSORS_TYPE:
        return _parse_safetensors(body)
    if kind == NPY_TYPE:
        return _parse_npy(body)
    raise ProtocolError(
        415,
        f"Content-Type {echo(kind)} is not supported",
        "tensor/binary, application/octet-stream, application/x-safetensors or application/x-npy",
    )


def _parse_raw(body: bytes, params: DecodeParams) -> Tensor:
    if params.shape is None:
        raise ProtocolError(422, "a raw tensor body needs the shape param", "shape=1&shape=16&...")
    dtype, itemsize = WIRE_DTYPES[params.dtype]
    expected = math.prod(params.shape) * itemsize
    if len(body) != expected:
        raise ProtocolError(
            400,
            f"body is {len(body)} bytes but shape {list(params.shape)} of {params.dtype} "
            f"needs {expected}",
            "little-endian tensor bytes, C order",
        )
    if not body:
        raise ProtocolError(400, "empty body", "the latent's bytes")
    # a bytearray body (how the service reads one) is used in place: no second copy
    buffer = body if isinstance(body, bytearray) else bytearray(body)
    return torch.frombuffer(buffer, dtype=dtype).reshape(params.shape)


# safetensors' names of the wire dtypes; a one-tensor header is a few hundred bytes
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
MAX_SAFETENSORS_HEADER = 1 << 20


def _parse_safetensors(body: bytes) -> Tensor:
    """One tensor, read in place: its header entry checked against the data first. By hand,
    as the format is a length, a JSON header and the data: safetensors' own loader takes
    ``bytes`` only, a second copy of the whole body that the body budget does not count."""
    view = memoryview(body)
    size = int.from_bytes(view[:8], "little") if len(view) >= 8 else -1
    if not 0 < size <= min(MAX_SAFETENSORS_HEADER, len(view) - 8):
        raise ProtocolError(400, _NOT_SAFETENSORS + f": a header of {size} bytes", ONE_TENSOR)
    try:
        header = json.loads(bytes(view[8 : 8 + size]))
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(400, f"{_NOT_SAFETENSORS}: {plain(exc)}", ONE_TENSOR) from None
    if not isinstance(header, dict):
        raise ProtocolError(400, _NOT_SAFETENSORS + ": its header is not an object", ONE_TENSOR)
    header.pop("__metadata__", None)
    if len(header) != 1:
        raise ProtocolError(400, f"safetensors body holds {len(header)} tensors", "exactly one")
    entry = next(iter(header.values()))
    entry = entry if isinstance(entry, dict) else {}
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not _ints(shape, MAX_DIM) or not _ints(offsets, len(view)) or len(offsets) != 2:
        raise ProtocolError(400, f"{_NOT_SAFETENSORS}: its entry {echo(entry)}", ONE_TENSOR)
    dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
    if dtype is None:
        raise ProtocolError(
            422, f"tensor dtype {echo(entry.get('dtype'))} is not supported", "F32|F16|BF16"
        )
    count, data = math.prod(shape), len(view) - 8 - size
    if offsets != [0, count * dtype.itemsize] or offsets[1] != data:
        raise ProtocolError(
            400,
            f"{_NOT_SAFETENSORS}: data offsets {echo(offsets)} for shape {echo(shape)} of "
            f"{entry['dtype']}, {data} data bytes",
            ONE_TENSOR,
        )
    if not count:
        return torch.empty(shape, dtype=dtype)
    # a bytearray body (how the service reads one) is used in place: no second copy
    buffer = body if isinstance(body, bytearray) else bytearray(body)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=8 + size).reshape(shape)


_NOT_SAFETENSORS = "body is not a valid safetensors file"
ONE_TENSOR = "a safetensors file of one tensor (F32, F16 or BF16)"


def _ints(values: object, most: int) -> bool:
    """Whether ``values`` is a list of integers, each 0..``most``."""
    return isinstance(values, list) and all(type(v) is int and 0 <= v <= most for v in values)


def _parse_npy(body: bytes) -> Tensor:
    """A ``.npy`` body, its header checked against the data before anything is allocated.

    ``np.load`` on a file-like object allocates the header's shape first, so a 100-byte body
    declaring a terabyte array would be honoured: the header is parsed here instead.
    """
    stream = io.BytesIO(bytes(memoryview(body)[:NPY_HEADER_MOST]))  # not a copy of the data
    try:
        version = np.lib.format.read_magic(stream)
        read_header = {
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
        }.get(version)
        if read_header is None:
            raise ValueError(f"version {version} is not supported (1.0 or 2.0)")
        shape, fortran_order, dtype = read_header(stream)
    except Exception as exc:  # numpy's header parser raises many types on hostile input
        raise ProtocolError(
            400, f"body is not a valid .npy file: {plain(exc)}", "a .npy file (format 1.0 or 2.0)"
        ) from None
    if dtype.kind != "f" or dtype.itemsize not in (2, 4) or dtype.fields is not None:
        raise ProtocolError(422, f".npy dtype {dtype} is not supported", "float32|float16")
    if not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape):
        raise ProtocolError(
            400,
            f".npy header declares shape {echo(list(shape)[:8])}",
            f"a shape of integers, each 0..{MAX_DIM}",
        )
    count = math.prod(shape)
    data = len(body) - stream.tell()
    if count * dtype.itemsize != data:
        raise ProtocolError(
            400,
            f".npy header declares shape {echo(list(shape)[:8])} ({count * dtype.itemsize} bytes) "
            f"but the body holds {data} data bytes",
            "a .npy whose data is exactly its header's shape",
        )
    if count == 0:
        raise ProtocolError(422, f".npy latent {list(shape)} is empty", "every dim >= 1")
    if not fortran_order and dtype.isnative:  # used in place, as a raw body: no copy
        buffer = body if isinstance(body, bytearray) else bytearray(body)
        data = torch.frombuffer(buffer, dtype=_TORCH_FLOATS[dtype.itemsize], offset=stream.tell())
        return data.reshape(shape)
    array = np.frombuffer(body, dtype=dtype, count=count, offset=stream.tell())
    array = array.reshape(shape, order="F" if fortran_order else "C")
    return torch.from_numpy(array.astype(dtype.newbyteorder("="), order="C", copy=True))


_TORCH_FLOATS = {2: torch.float16, 4: torch.float32}
