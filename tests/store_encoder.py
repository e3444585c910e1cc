"""A stand-in encoder family for the store's tests (registered in ``app.encoders.ENCODERS`` by
them): one convolution whose width comes from the config, so a config can disagree with
weights. The store checks encoder weights against whatever class the family registers."""

from __future__ import annotations

from typing import Any

from torch import nn


class Encoder(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(3, config["width"], 3)
