"""Where Wan encoder weights come from: a diffusers ``vae/`` folder (``AutoencoderKLWan``:
Wan 2.1, Wan 2.2 TI2V; ``AutoencoderKLQwenImage``). The config keeps diffusers' encoder keys;
``variant`` says which model it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from app.decoders.wan.convert import WAN21_MEAN, WAN21_STD
from app.encoders import video
from app.encoders.wan.encode import DEFAULTS

CLASSES = ("AutoencoderKLWan", "AutoencoderKLQwenImage")


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    raw, tensors = video.read_vae_folder(source)
    name = raw.get("_class_name")
    if name not in CLASSES:
        raise ValueError(f"{source}: _class_name {name!r} is not one of {', '.join(CLASSES)}")
    config = {k: raw.get(k, v) for k, v in DEFAULTS.items()}
    if name == "AutoencoderKLQwenImage":
        temporal = list(raw.get("temperal_downsample", DEFAULTS["temperal_downsample"]))
        config.update(
            variant="qwen-image",
            in_channels=raw.get("input_channels", 3),
            is_residual=False,
            patch_size=None,
            spatial_compression_ratio=2 ** len(temporal),  # as its tiled_encode measures
        )
    else:
        config["variant"] = "wan2.2" if raw.get("is_residual") else "wan2.1"
        config["spatial_compression_ratio"] = raw.get("scale_factor_spatial") or 8
    config["latents_mean"] = list(raw.get("latents_mean", WAN21_MEAN))
    config["latents_std"] = list(raw.get("latents_std", WAN21_STD))
    return video.jsonable(config), video.encoder_state(tensors)
