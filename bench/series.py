"""Prometheus series a replica exports after one request per model and output.

    python -m bench series --url http://127.0.0.1:8080

Sends each served model (GET /models) one small latent per output it can produce (PNG, JPEG,
WebP, a float tensor, a uint8 tensor, a [0,1] tensor, and MP4 for video models), then counts
the sample lines of /metrics (everything but # comments) in all and per model. The bound and
the counts are in docs/metrics.md, "Series per replica".
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import httpx
import numpy as np

# output label -> (query params, Accept header)
OUTPUTS: dict[str, tuple[dict[str, str], str]] = {
    "png": ({"output_type": "pil", "image_format": "png"}, "image/png"),
    "jpg": ({"output_type": "pil", "image_format": "jpg"}, "image/jpeg"),
    "webp": ({"output_type": "pil", "image_format": "webp"}, "image/webp"),
    "tensor": ({"output_type": "pt"}, "tensor/binary"),
    "uint8": ({"output_type": "pt", "partial_postprocess": "true"}, "tensor/binary"),
    "unit_tensor": ({"output_type": "pil"}, "tensor/binary"),
}
IMAGE_ONLY = ("png", "jpg", "webp")  # a video model answers these 422 for a multi-frame latent
VIDEO_OUTPUTS = {"mp4": ({"output_type": "mp4"}, "video/mp4")}


def outputs_of(config: dict[str, Any]) -> dict[str, tuple[dict[str, str], str]]:
    """The outputs a model produces for a small latent of ``latent_shape(config)``."""
    if not config.get("video"):
        return OUTPUTS
    return {**{k: v for k, v in OUTPUTS.items() if k not in IMAGE_ONLY}, **VIDEO_OUTPUTS}


def latent_shape(config: dict[str, Any]) -> list[int]:
    shape = [1, int(config["latent_channels"])]
    return shape + ([2, 2, 2] if config.get("video") else [2, 2])


def send_each(url: str, models: list[dict[str, Any]]) -> dict[tuple[str, str], int]:
    """One request per model and output; their status codes."""
    codes = {}
    with httpx.Client(base_url=url, timeout=600) as http:
        for model in models:
            shape = latent_shape(model["config"])
            body = np.random.default_rng(0).standard_normal(shape).astype("<f4").tobytes()
            for output, (params, accept) in outputs_of(model["config"]).items():
                query = [("shape", d) for d in shape] + list(params.items())
                r = http.post(f"/decode/{model['name']}", params=query, content=body,
                              headers={"Content-Type": "tensor/binary", "Accept": accept})  # fmt: skip
                codes[(model["name"], output)] = r.status_code
    return codes


def count_series(text: str) -> tuple[int, Counter[str]]:
    """Sample lines in all, and per ``model`` label value ("" for model-less series)."""
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    per_model: Counter[str] = Counter()
    for line in lines:
        labels = line.partition("{")[2]
        model = labels.split('model="', 1)[1].split('"', 1)[0] if 'model="' in labels else ""
        per_model[model] += 1
    return len(lines), per_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--repeat", type=int, default=1, help="requests per model and output")


def run(args: argparse.Namespace) -> None:
    models = httpx.get(f"{args.url}/models", timeout=30).json()["models"]
    for _ in range(args.repeat):
        codes = send_each(args.url, models)
    failed = {k: v for k, v in codes.items() if v != 200}
    text = httpx.get(f"{args.url}/metrics", timeout=30).text
    total, per_model = count_series(text)
    print(f"{len(codes)} requests ({len(failed)} not 200: {failed or 'none'})")
    print(f"series: {total}")
    print("| model | series |\n|---|---|")
    for model, n in sorted(per_model.items()):
        print(f"| {model or '(no model label)'} | {n} |")
