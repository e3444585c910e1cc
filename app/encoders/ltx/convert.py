"""Where LTX encoder weights come from: a diffusers ``vae/`` folder (``AutoencoderKLLTXVideo``
or ``AutoencoderKLLTX2Video``). Its config's encoder keys are kept; an LTX-2 one gets
``"version": "ltx2"``. Lightricks single files are not read here (decoder side only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from app.encoders import video
from app.encoders.ltx.encode import DEFAULTS, LTX2_DEFAULTS, VERSION_LTX2

EXTRA_KEYS = ("spatial_compression_ratio", "temporal_compression_ratio")


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    raw, tensors = video.read_vae_folder(source)
    ltx2 = "LTX2" in str(raw.get("_class_name", ""))
    base = LTX2_DEFAULTS if ltx2 else DEFAULTS
    config = {k: raw.get(k, v) for k, v in base.items()}
    if ltx2:
        config["version"] = VERSION_LTX2
    config.update({k: raw[k] for k in EXTRA_KEYS if raw.get(k)})
    mean, std = tensors.get("latents_mean"), tensors.get("latents_std")
    if mean is not None and std is not None:
        config["latents_mean"] = mean.float().flatten().tolist()
        config["latents_std"] = std.float().flatten().tolist()
    return video.jsonable(config), video.encoder_state(tensors)
