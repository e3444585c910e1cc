"""The decode and encode routes' OpenAPI description: the body types and the query params."""

from __future__ import annotations

BODY_DOC = {
    "requestBody": {
        "required": True,
        "description": "The latent: raw little-endian tensor bytes (with `shape` and `dtype` "
        "params), a safetensors file holding one tensor, or a `.npy` file.",
        "content": {
            "tensor/binary": {"schema": {"type": "string", "format": "binary"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "application/x-safetensors": {"schema": {"type": "string", "format": "binary"}},
            "application/x-npy": {"schema": {"type": "string", "format": "binary"}},
        },
    },
    "parameters": [
        {"name": n, "in": "query", "required": False, "schema": s, "description": d}
        for n, s, d in [
            (
                "shape",
                {"type": "array", "items": {"type": "integer"}},
                "latent shape for raw bodies; repeated keys or a JSON list",
            ),
            ("dtype", {"type": "string", "enum": ["float32", "float16", "bfloat16"]}, "raw dtype"),
            (
                "output_type",
                {"type": "string", "enum": ["pil", "pt", "mp4", "preview"]},
                "what to return (preview: the latent-to-RGB map, no decoder)",
            ),
            ("image_format", {"type": "string", "enum": ["png", "jpg", "webp"]}, "image format"),
            ("partial_postprocess", {"type": "boolean"}, "pt: uint8 [B,H,W,3] instead"),
            ("scaling_factor", {"type": "number"}, "latent / scaling_factor"),
            ("shift_factor", {"type": "number"}, "latent + shift_factor"),
            ("do_scaling", {"type": "boolean"}, "apply the model's own de-normalization"),
            ("height", {"type": "integer"}, "pixel height for packed latents"),
            ("width", {"type": "integer"}, "pixel width for packed latents"),
            ("fps", {"type": "number"}, "mp4 frame rate"),
            ("timestep", {"type": "number"}, "decode timestep (timestep-conditioned LTX)"),
            ("seed", {"type": "integer"}, "noise seed (LTX noise injection)"),
            ("quality", {"type": "integer"}, "jpg/webp quality 1..100"),
            ("timeout", {"type": "number"}, "seconds this request may wait to start (capped)"),
            ("frame", {"type": "integer"}, "preview of a video latent: its latent frame"),
        ]
    ]
    + [
        {
            "name": "X-Request-Timeout",
            "in": "header",
            "required": False,
            "schema": {"type": "number"},
            "description": "seconds this request may wait to start; capped by the server",
        }
    ],
}

_BINARY = {"schema": {"type": "string", "format": "binary"}}
ENCODE_BODY_DOC = {
    "requestBody": {
        "required": True,
        "description": "An image (PNG without Content-Type, as remote_encode sends it; JPEG, "
        "WebP), RGB pixels in [-1, 1] as raw tensor bytes (with `shape` and `dtype`), "
        "safetensors or `.npy`, or an MP4 for a video model. Answer: the latent, raw bytes "
        "with `shape`/`dtype` headers (safetensors or `.npy` on Accept).",
        "content": {
            kind: _BINARY
            for kind in (
                "image/png",
                "image/jpeg",
                "image/webp",
                "video/mp4",
                "tensor/binary",
                "application/octet-stream",
                "application/x-safetensors",
                "application/x-npy",
            )
        },
    },
    "parameters": [
        {"name": n, "in": "query", "required": False, "schema": s, "description": d}
        for n, s, d in [
            (
                "shape",
                {"type": "array", "items": {"type": "integer"}},
                "pixel shape for raw bodies: [B,3,H,W] or [B,3,T,H,W]",
            ),
            ("dtype", {"type": "string", "enum": ["float32", "float16", "bfloat16"]}, "raw dtype"),
            ("scaling_factor", {"type": "number"}, "(latent - shift_factor) * scaling_factor"),
            ("shift_factor", {"type": "number"}, "subtracted before scaling"),
            ("do_scaling", {"type": "boolean"}, "apply the model's own normalisation"),
            ("sample", {"type": "boolean"}, "a seeded sample instead of the mean"),
            ("seed", {"type": "integer"}, "the sample's noise seed (with sample=true)"),
            ("packed", {"type": "boolean"}, "FLUX's packed [B,(h/2)(w/2),4C] layout"),
            ("timeout", {"type": "number"}, "seconds this request may wait to start (capped)"),
        ]
    ],
}
