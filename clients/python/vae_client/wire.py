"""The wire format (diffusers' ``remote_decode``): latents -> request body and query,
responses -> bytes or numpy. No torch: a torch tensor is encoded only when the caller
already has torch loaded."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from vae_client.errors import DecodeError

# output -> (query params, Accept): the same params remote_decode sends for each
OUTPUTS: dict[str, tuple[dict[str, str], str]] = {
    "png": ({"output_type": "pil", "image_format": "png"}, "image/png"),
    "jpeg": ({"output_type": "pil", "image_format": "jpg"}, "image/jpeg"),
    "webp": ({"output_type": "pil", "image_format": "webp"}, "image/webp"),
    "mp4": ({"output_type": "mp4"}, "video/mp4"),
    "tensor": ({"output_type": "pt"}, "tensor/binary"),  # decoder output space, or uint8
    "frames": ({"output_type": "pil"}, "tensor/binary"),  # [N,3,H,W] in [0,1]
}
ARRAY_OUTPUTS = frozenset({"tensor", "frames"})  # returned as numpy, saved as .npy
ALIASES = {"jpg": "jpeg", "pt": "tensor", "npy": "tensor"}
SUFFIX_OUTPUT = {
    ".png": "png",
    ".jpg": "jpeg",
    ".jpeg": "jpeg",
    ".webp": "webp",
    ".mp4": "mp4",
    ".npy": "tensor",
}
LATENT_FILE_TYPES = {".npy": "application/x-npy", ".safetensors": "application/x-safetensors"}
RESPONSE_DTYPES = {"float32": np.float32, "float16": np.float16, "uint8": np.uint8}


@dataclass
class Request:
    """One decode request, ready to send (and to send again on a retry)."""

    path: str
    params: list[tuple[str, str]]
    headers: dict[str, str]
    body: bytes
    output: str


def output_name(output: str) -> str:
    """``"jpg"`` -> ``"jpeg"``; ValueError for a name the service has no output for."""
    name = ALIASES.get(output.lower(), output.lower())
    if name not in OUTPUTS:
        raise ValueError(f"output {output!r} is not one of {', '.join(OUTPUTS)}")
    return name


def output_for_path(path: Path) -> str:
    """The output a file's suffix asks for: ``out.webp`` -> ``"webp"``."""
    try:
        return SUFFIX_OUTPUT[path.suffix.lower()]
    except KeyError:
        raise ValueError(
            f"{path}: cannot tell the output format from the suffix "
            f"(use {', '.join(SUFFIX_OUTPUT)})"
        ) from None


def build_request(
    latent: Any, model: str | None, output: str, params: dict[str, Any], token: str | None
) -> Request:
    name = output_name(output)
    body, content_type, wire = encode_latent(latent, params)
    fixed, accept = OUTPUTS[name]
    query = encode_query({**fixed, **wire, **params})
    headers = {"Content-Type": content_type, "Accept": accept, "X-Request-Id": uuid.uuid4().hex}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    path = f"/decode/{model}" if model else "/decode"
    return Request(path, query, headers, body, name)


def encode_latent(latent: Any, params: dict[str, Any]) -> tuple[bytes, str, dict[str, Any]]:
    """Latent -> (body, Content-Type, wire params). Raw bytes need ``shape`` (and ``dtype``)."""
    if isinstance(latent, bytes | bytearray | memoryview):
        if "shape" not in params:
            raise ValueError("a raw bytes latent needs shape=[...] (and dtype=, default float32)")
        return bytes(latent), "tensor/binary", {}
    if isinstance(latent, os.PathLike):
        path = Path(latent)
        if path.suffix.lower() not in LATENT_FILE_TYPES:
            raise ValueError(f"{path}: a latent file is .npy or .safetensors")
        return path.read_bytes(), LATENT_FILE_TYPES[path.suffix.lower()], {}
    if type(latent).__module__.split(".")[0] == "torch":
        return _encode_torch(latent)
    array = np.asarray(latent)
    if array.dtype == np.float64:
        array = array.astype(np.float32)  # the wire has no float64
    if array.dtype not in (np.float32, np.float16):
        raise ValueError(f"latent dtype {array.dtype} is not float32 or float16")
    array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return array.tobytes(), "tensor/binary", {"shape": list(array.shape), "dtype": array.dtype.name}


def _encode_torch(tensor: Any) -> tuple[bytes, str, dict[str, Any]]:
    import torch  # the caller has it loaded already: this costs nothing

    t = tensor.detach().to("cpu").contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype == "bfloat16":  # numpy has no bfloat16: ship the raw 16-bit words
        data = t.view(torch.int16).numpy().astype("<i2").tobytes()
    elif dtype in ("float32", "float16"):
        data = t.numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()
    else:
        t, dtype = t.float(), "float32"
        data = t.numpy().astype("<f4").tobytes()
    return data, "tensor/binary", {"shape": list(t.shape), "dtype": dtype}


def encode_query(params: dict[str, Any]) -> list[tuple[str, str]]:
    """remote_decode's conventions: lists as repeated keys, booleans as true/false."""
    items: list[tuple[str, str]] = []
    for key, value in params.items():
        if value is None:
            continue
        values = value if isinstance(value, list | tuple) else [value]
        for v in values:
            items.append((key, ("true" if v else "false") if isinstance(v, bool) else str(v)))
    return items


def decode_response(output: str, content: bytearray, headers: httpx.Headers) -> bytes | np.ndarray:
    """Encoded media as bytes; tensors as numpy over the received buffer (writable, no copy)."""
    return response_array(content, headers) if output in ARRAY_OUTPUTS else bytes(content)


def response_array(content: bytes | bytearray, headers: httpx.Headers) -> np.ndarray:
    """A tensor response (``shape`` and ``dtype`` headers) -> numpy (bfloat16 -> float32)."""
    shape = json.loads(headers.get("shape", "null"))
    dtype = headers.get("dtype", "float32")
    if dtype == "bfloat16":
        words = np.frombuffer(content, dtype="<u2").astype(np.uint32) << 16
        return words.view(np.float32).reshape(shape)
    if dtype not in RESPONSE_DTYPES:
        raise DecodeError(None, f"unexpected tensor dtype {dtype!r} in the response")
    return np.frombuffer(content, dtype=np.dtype(RESPONSE_DTYPES[dtype]).newbyteorder("<")).reshape(
        shape
    )
