"""A stand-in family for the store's tests (``app.families.register(KEY, "tests.store_encoder")``
by them, as ``registered()`` does): FLUX's decoder (its class, converter and seeded weights)
with a stand-in encoder of one convolution whose width comes from the config, so a config can
disagree with weights, and a ``convert`` that finds it in a diffusers checkpoint. The store
checks encoder weights against whatever class the family describes; ``import`` stores what
``convert`` finds (and the encoder's gate reference: the stand-in is a ``VAEEncoder``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

import app.families
from app.families.descriptor import Family, Part
from app.families.encoder import VAEEncoder
from app.families.flux import decoder as flux

KEY = "store-flux"


class Decoder(flux.Decoder):
    """FLUX's decoder under this family's key (the descriptor sets ``family`` on its class)."""


class Encoder(VAEEncoder):
    gaussian = False  # the convolution's output is the latent itself

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.conv_in = nn.Conv2d(3, config["width"], 3, padding=config.get("padding", 0))

    # Its latent is declared, not computed: the store pairs an encoder only with a decoder of
    # the same latent, and the stand-in stands beside the store tests' FLUX decoders (16
    # channels, x4: tests/test_store_atomic.py's CFG); its convolution is what the tests vary.
    @property
    def latent_channels(self) -> int:
        return int(self.config.get("latent_channels", 16))

    @property
    def spatial_scale(self) -> int:
        return int(self.config.get("spatial_scale", 4))

    def moments(self, x: Tensor, **options: Any) -> Tensor:
        return self.conv_in(x)


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]] | None:
    """A diffusers ``AutoencoderKL`` folder's ``encoder.conv_in`` (None when it has none)."""
    state = load_file(str(Path(source) / "diffusion_pytorch_model.safetensors"))
    if "encoder.conv_in.weight" not in state:
        return None
    weight = state["encoder.conv_in.weight"]
    config = {"width": weight.shape[0], "padding": 1}
    return config, {"conv_in.weight": weight, "conv_in.bias": state["encoder.conv_in.bias"]}


def init_synthetic(encoder: Encoder, generator: torch.Generator) -> None:
    with torch.no_grad():
        for p in encoder.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


FAMILY = Family(
    KEY,
    decoder=Part(Decoder, flux.convert, flux.init_synthetic),
    encoder=Part(Encoder, convert, init_synthetic),
)


def register() -> None:
    app.families.register(KEY, __name__)


@contextmanager
def registered() -> Iterator[None]:
    """``store-flux`` is a known family inside the block only."""
    register()
    try:
        yield
    finally:
        app.families.unregister(KEY)
