"""TAEF2's tiny encoder, for tests only: photos -> FLUX.2 latents for the round trip.

The service never encodes. Built from ``taef2_encoder.pth``'s own key names and
shapes (madebyollin's flat ``nn.Sequential``): a first conv, residual blocks
(the last stage's with the GroupNorm pool branch), bias-free stride-2 convs
between stages, and a last conv to the 32 latent channels. Input RGB in [0, 1].
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from app.families.taesd.decoder.model import DEFAULTS, Block


def _layer(entry: dict[str, Tensor], first_or_last: bool) -> nn.Module:
    if "conv.0.weight" in entry:
        w = entry["conv.0.weight"]
        pool = entry.get("pool.0.weight")
        width = 0 if pool is None else int(pool.shape[0])
        return Block(w.shape[1], w.shape[0], width, DEFAULTS["mid_pool_groups"])
    w = entry["weight"]
    # The bias-free convs between stages are the 2x downsamplers.
    stride = 1 if first_or_last or "bias" in entry else 2
    return nn.Conv2d(w.shape[1], w.shape[0], 3, stride=stride, padding=1, bias="bias" in entry)


def load_encoder(path: Path) -> nn.Sequential:
    sd = torch.load(path, weights_only=True, map_location="cpu")
    groups: dict[int, dict[str, Tensor]] = {}
    for key, value in sd.items():
        index, rest = key.split(".", 1)
        groups.setdefault(int(index), {})[rest] = value
    last = max(groups)
    if sorted(groups) != list(range(last + 1)):
        raise ValueError("taef2 encoder: expected one parameterised module per index")
    encoder = nn.Sequential(*(_layer(groups[i], i in (0, last)) for i in range(last + 1)))
    encoder.load_state_dict(sd)
    return encoder.float().eval()
