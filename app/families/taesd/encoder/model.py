"""The TAESD-family tiny encoder (TAESD, TAEF1, TAEF2): madebyollin's conv/ReLU encoder.

Layout for ``channels = [c0, ..., cn]`` and ``blocks = [b0, ..., bn]``::

    conv_in   3x3 conv RGB (in [0, 1]) -> c0 (no activation)
    down_0    b0 blocks at c0 (full resolution)
    down_i    3x3 stride-2 conv c_{i-1} -> c_i (no bias), b_i blocks
    conv_out  3x3 conv cn -> latent channels (the latent itself: no logvar)

TAEF2 adds the decoder's GroupNorm "pool" branch to the blocks of its last stage
(``pool_channels`` per stage). The blocks are the decoder's (``app.families.taesd.decoder.model``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from app.families.encoder import VAEEncoder
from app.families.taesd.decoder.model import DEFAULTS as DECODER_DEFAULTS
from app.families.taesd.decoder.model import VARIANT_CHANNELS, Block, conv3

DEFAULTS: dict[str, Any] = {
    "channels": [64, 64, 64, 64],
    "blocks": [1, 3, 3, 3],
    # Pool-branch width per stage (0 = none); TAEF2's last stage has 4 * c.
    "pool_channels": [0, 0, 0, 0],
    "pool_groups": DECODER_DEFAULTS["mid_pool_groups"],
    # diffusers' AutoencoderTiny tiles: 512 px, blended over 1/8 of a tile.
    "tile_sample_size": 512,
    "tile_overlap_factor": 0.125,
}


def normalize_config(config: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults and check the geometry; a bad config fails here, not mid-encode."""
    variant = config.get("variant", "taesd")
    if variant not in VARIANT_CHANNELS:
        raise ValueError(
            f"taesd: unknown variant {variant!r}; known: {', '.join(VARIANT_CHANNELS)}"
        )
    cfg = {**DEFAULTS, "latent_channels": VARIANT_CHANNELS[variant], **config, "variant": variant}
    stages = len(cfg["channels"])
    if variant == "taef2" and "pool_channels" not in config:
        cfg["pool_channels"] = [0] * (stages - 1) + [4 * cfg["channels"][-1]]
    for key in ("channels", "blocks", "pool_channels"):
        cfg[key] = [int(v) for v in cfg[key]]
        if len(cfg[key]) != stages or stages < 1:
            raise ValueError(f"taesd encoder: {key!r} needs one entry per stage ({stages})")
    if any(p % cfg["pool_groups"] for p in cfg["pool_channels"]):
        raise ValueError("taesd encoder: pool_channels must be multiples of pool_groups")
    return cfg


class DownStage(nn.Module):
    """[3x3 stride-2 bias-free conv], then blocks."""

    def __init__(self, c_in: int, c_out: int, n_blocks: int, downsample: bool, pool: tuple):
        super().__init__()
        self.conv = (
            nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False) if downsample else None
        )
        self.blocks = nn.Sequential(*(Block(c_out, c_out, *pool) for _ in range(n_blocks)))

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x if self.conv is None else self.conv(x))


class EncoderModel(VAEEncoder):
    """The layers and the forward (RGB in [0, 1] -> latent); ``encode.Encoder`` adds the rest."""

    gaussian = False

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(normalize_config(config))
        cfg = self.config
        ch, blocks = cfg["channels"], cfg["blocks"]
        self.conv_in = conv3(3, ch[0])
        self.down = nn.ModuleList(
            DownStage(
                ch[max(i - 1, 0)],
                ch[i],
                blocks[i],
                downsample=i > 0,
                pool=(cfg["pool_channels"][i], cfg["pool_groups"]),
            )
            for i in range(len(ch))
        )
        self.conv_out = conv3(ch[-1], cfg["latent_channels"])

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_in(x)
        for stage in self.down:
            x = stage(x)
        return self.conv_out(x)
