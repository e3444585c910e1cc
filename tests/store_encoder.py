"""A stand-in encoder family for the store's tests (registered in ``app.encoders.ENCODERS`` by
them): one convolution whose width comes from the config, so a config can disagree with
weights, and a ``convert`` that finds it in a diffusers checkpoint. The store checks encoder
weights against whatever class the family registers; ``import`` stores what ``convert`` finds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from torch import Tensor, nn


class Encoder(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(3, config["width"], 3, padding=config.get("padding", 0))


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]] | None:
    """A diffusers ``AutoencoderKL`` folder's ``encoder.conv_in`` (None when it has none)."""
    state = load_file(str(Path(source) / "diffusion_pytorch_model.safetensors"))
    if "encoder.conv_in.weight" not in state:
        return None
    weight = state["encoder.conv_in.weight"]
    config = {"width": weight.shape[0], "padding": 1}
    return config, {"conv_in.weight": weight, "conv_in.bias": state["encoder.conv_in.bias"]}
