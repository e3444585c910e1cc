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

from vae_client.answers import FRAMES_MAJOR
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


def output_for_path(path: str | os.PathLike) -> str:
    """The output a file's suffix asks for: ``out.webp`` -> ``"webp"``."""
    path = Path(path)
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
    if name == "tensor":  # a video's frames each as it decodes (put back in place on receipt)
        headers["X-Tensor-Layout"] = FRAMES_MAJOR
    if token:
        headers["Authorization"] = f"Bearer {token}"
    path = f"/decode/{model}" if model else "/decode"
    return Request(path, query, headers, body, name)


def encode_latent(latent: Any, params: dict[str, Any]) -> tuple[bytes, str, dict[str, Any]]:
    """Latent -> (body, Content-Type, wire params). Raw bytes need ``shape`` (and ``dtype``);
    a ``str`` or ``os.PathLike`` is a ``.npy`` / ``.safetensors`` file, sent as it is."""
    if isinstance(latent, bytes | bytearray | memoryview):
        if "shape" not in params:
            raise ValueError("a raw bytes latent needs shape=[...] (and dtype=, default float32)")
        return bytes(latent), "tensor/binary", {}
    if isinstance(latent, str | os.PathLike):
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


# --- encode (diffusers' ``remote_encode``): pixels -> request, latent response -> numpy ----

# Accept -> how the latent comes back: a raw tensor (``shape``/``dtype`` headers), or a file
LATENT_ACCEPT = {
    "raw": "tensor/binary",
    "npy": "application/x-npy",
    "safetensors": "application/x-safetensors",
}
LATENT_SUFFIX = {".bin": "raw", ".npy": "npy", ".safetensors": "safetensors"}
MEDIA_SUFFIX = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".webp": "image/webp",
    ".mp4": "video/mp4",
}


def sniff_media(data: bytes) -> str | None:
    """The Content-Type of encoded image/video bytes from their magic numbers, else None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[4:8] == b"ftyp":
        return "video/mp4"
    return None


def latent_format_for_path(path: str | os.PathLike) -> str:
    """``z.safetensors`` -> ``"safetensors"``; ValueError for a suffix with no latent format."""
    path = Path(path)
    try:
        return LATENT_SUFFIX[path.suffix.lower()]
    except KeyError:
        raise ValueError(
            f"{path}: a latent file is {', '.join(LATENT_SUFFIX)} (the suffix names the format)"
        ) from None


def encode_params(
    scaling_factor: float | None = None,
    shift_factor: float | None = None,
    do_scaling: bool = False,
    sample: bool = False,
    seed: int | None = None,
    packed: bool = False,
) -> dict[str, Any]:
    """The encode route's query params; defaults are left out (the server's are the same)."""
    params: dict[str, Any] = {"scaling_factor": scaling_factor, "shift_factor": shift_factor}
    params.update(do_scaling=do_scaling or None, sample=sample or None, packed=packed or None)
    if seed is not None:
        if not sample:
            raise ValueError("seed only applies to sample=True (the mean has no noise)")
        params["seed"] = seed
    return {k: v for k, v in params.items() if v is not None}


def build_encode_request(
    image: Any, model: str | None, params: dict[str, Any], latent_format: str = "raw"
) -> Request:
    """One encode request: ``image`` as the body (see ``encode_pixels``), ``params`` as the
    query, ``latent_format`` (raw / npy / safetensors) as the Accept."""
    if latent_format not in LATENT_ACCEPT:
        raise ValueError(
            f"latent format {latent_format!r} is not one of {', '.join(LATENT_ACCEPT)}"
        )
    body, content_type, wire = encode_pixels(image)
    headers = {"Accept": LATENT_ACCEPT[latent_format], "X-Request-Id": uuid.uuid4().hex}
    if content_type:
        headers["Content-Type"] = content_type
    path = f"/encode/{model}" if model else "/encode"
    return Request(path, encode_query({**wire, **params}), headers, body, latent_format)


def encode_pixels(image: Any) -> tuple[bytes, str, dict[str, Any]]:
    """Pixels -> (body, Content-Type, wire params).

    A PIL image goes as PNG (lossless, as ``remote_encode`` sends it); PNG/JPEG/WebP/MP4 bytes
    or a file path as they are; a numpy array (or torch tensor) ``[B,3,H,W]`` / ``[B,3,T,H,W]``
    in [-1, 1] as a raw little-endian tensor with ``shape`` and ``dtype``."""
    if isinstance(image, bytes | bytearray | memoryview):
        data = bytes(image)
        content_type = sniff_media(data)
        if content_type is None:
            raise ValueError(
                "image bytes are not PNG, JPEG, WebP or MP4 (send raw pixels as a numpy array)"
            )
        return data, content_type, {}
    if isinstance(image, str | os.PathLike):
        path = Path(image)
        if path.suffix.lower() not in MEDIA_SUFFIX:
            raise ValueError(f"{path}: an image or video file is {', '.join(MEDIA_SUFFIX)}")
        return path.read_bytes(), MEDIA_SUFFIX[path.suffix.lower()], {}
    if hasattr(image, "save") and hasattr(image, "mode"):  # a PIL image (Pillow is optional)
        import io

        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue(), "image/png", {}
    if type(image).__module__.split(".")[0] == "torch":
        body, content_type, wire = _encode_torch(image)
    else:
        array = np.asarray(image)
        if array.dtype == np.float64:
            array = array.astype(np.float32)  # the wire has no float64
        if array.dtype not in (np.float32, np.float16):
            raise ValueError(
                f"pixel array dtype {array.dtype}: send float32/float16 in [-1, 1] "
                "(or encoded PNG/JPEG bytes, or a PIL image)"
            )
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        body, content_type = array.tobytes(), "tensor/binary"
        wire = {"shape": list(array.shape), "dtype": array.dtype.name}
    shape = wire["shape"]
    if len(shape) not in (4, 5) or shape[1] != 3:
        raise ValueError(f"pixels of shape {shape}: expected [B,3,H,W] or [B,3,T,H,W]")
    return body, content_type, wire


def latent_response(
    latent_format: str, content: bytes | bytearray, headers: httpx.Headers
) -> np.ndarray:
    """An encode response -> numpy: raw (``shape``/``dtype`` headers, bfloat16 -> float32),
    ``.npy`` or safetensors (its one tensor; needs the ``safetensors`` package)."""
    if latent_format == "raw":
        return response_array(content, headers)
    if latent_format == "npy":
        import io

        return np.load(io.BytesIO(bytes(content)), allow_pickle=False)
    from safetensors.numpy import load as load_safetensors

    tensors = load_safetensors(bytes(content))
    if len(tensors) != 1:
        raise DecodeError(
            None, f"expected one tensor in the safetensors answer, got {list(tensors)}"
        )
    return next(iter(tensors.values()))
