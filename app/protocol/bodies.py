"""Request bodies -> tensors: raw remote_decode bytes, safetensors, ``.npy``.

Every parser checks what a body declares against what it holds before allocating anything
sized by the request.
"""

from __future__ import annotations

import io
import math

import numpy as np
import torch
from torch import Tensor

from app.protocol.errors import ProtocolError, echo, plain
from app.protocol.params import MAX_DIM, WIRE_DTYPES, DecodeParams

RAW_TYPES = {"tensor/binary", "application/octet-stream"}
SAFETENSORS_TYPE = "application/x-safetensors"
NPY_TYPE = "application/x-npy"
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
        raise ProtocolError(400, "empty body")
    # a bytearray body (how the service reads one) is used in place: no second copy
    buffer = body if isinstance(body, bytearray) else bytearray(body)
    return torch.frombuffer(buffer, dtype=dtype).reshape(params.shape)


def _parse_safetensors(body: bytes) -> Tensor:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(bytes(body))  # safetensors takes bytes only
    except (SafetensorError, ValueError, RuntimeError, OverflowError) as exc:
        raise ProtocolError(400, f"body is not a valid safetensors file: {plain(exc)}") from None
    if len(tensors) != 1:
        raise ProtocolError(400, f"safetensors body holds {len(tensors)} tensors", "exactly one")
    tensor = next(iter(tensors.values()))
    if tensor.dtype not in {d for d, _ in WIRE_DTYPES.values()}:
        raise ProtocolError(
            422, f"tensor dtype {tensor.dtype} is not supported", "float32|float16|bfloat16"
        )
    return tensor


def _parse_npy(body: bytes) -> Tensor:
    """A ``.npy`` body, its header checked against the data before anything is allocated.

    ``np.load`` on a file-like object allocates the header's shape first, so a 100-byte body
    declaring a terabyte array would be honoured: the header is parsed here instead.
    """
    stream = io.BytesIO(body)
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
        raise ProtocolError(400, f"body is not a valid .npy file: {plain(exc)}") from None
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
        )
    if count == 0:
        raise ProtocolError(422, f".npy latent {list(shape)} is empty", "every dim >= 1")
    array = np.frombuffer(body, dtype=dtype, count=count, offset=stream.tell())
    array = array.reshape(shape, order="F" if fortran_order else "C")
    return torch.from_numpy(array.astype(dtype.newbyteorder("="), order="C", copy=True))
