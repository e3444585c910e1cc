"""Where HunyuanVideo encoder weights come from: a diffusers ``vae/`` folder
(``AutoencoderKLHunyuanVideo``). The original Tencent checkpoint uses the same names under
``vae.``; it is not read here yet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from app.encoders import video
from app.encoders.hunyuan_video.encode import DEFAULTS

CLASS = "AutoencoderKLHunyuanVideo"
DOWN_BLOCK = "HunyuanVideoDownBlock3D"


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    raw, tensors = video.read_vae_folder(source)
    if raw.get("_class_name") != CLASS:
        raise ValueError(f"{source}: _class_name {raw.get('_class_name')!r} is not {CLASS}")
    blocks = raw.get("down_block_types") or [DOWN_BLOCK]
    if any(b != DOWN_BLOCK for b in blocks):
        raise ValueError(f"{source}: down_block_types {blocks}: expected {DOWN_BLOCK} each")
    if raw.get("act_fn", "silu") not in ("silu", "swish"):
        raise ValueError(f"{source}: act_fn {raw['act_fn']!r}: HunyuanVideo uses silu")
    config = {k: raw.get(k, v) for k, v in DEFAULTS.items()}
    return video.jsonable(config), video.encoder_state(tensors)
