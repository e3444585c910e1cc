"""Decoded pixels -> response bytes: PNG, JPEG/WebP via Pillow, tensors as raw bytes."""

from __future__ import annotations

import io
import json

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from app.media.png import encode_png

PIL_FORMAT = {"png": "PNG", "jpg": "JPEG", "webp": "WEBP"}
WIRE_NAME = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.uint8: "uint8",
}


def encode_image(frame: Tensor, fmt: str, quality: int = 90) -> bytes:
    """One uint8 image [H,W,3] -> encoded bytes: PNG with fpng or Pillow (app/media/png.py), JPEG
    and WebP with Pillow."""
    pixels = frame.contiguous().numpy()
    if fmt == "png":
        return encode_png(pixels)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format=PIL_FORMAT[fmt], quality=quality)
    return buf.getvalue()


def tensor_bytes(tensor: Tensor) -> tuple[bytes, dict[str, str]]:
    """Raw little-endian bytes plus the ``shape``/``dtype`` headers remote_decode reads."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the raw 16-bit words
        data = tensor.view(torch.int16).numpy().astype("<i2").tobytes()
    else:
        data = (
            np.ascontiguousarray(tensor.numpy())
            .astype(tensor.numpy().dtype.newbyteorder("<"))
            .tobytes()
        )
    headers = {"shape": json.dumps(list(tensor.shape)), "dtype": WIRE_NAME[tensor.dtype]}
    return data, headers
