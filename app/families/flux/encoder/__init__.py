"""The FLUX family's encoders: diffusers ``AutoencoderKL`` (FLUX.1, SD3, SDXL/SD1.5) and
``AutoencoderKLFlux2``'s. ``model.py`` is the exact architecture, ``encode.py`` the
``Encoder`` (moments, tiles, normalisation), ``convert.py`` the checkpoint layouts,
``synthetic.py`` the seeded weights."""

from app.families.flux.encoder.convert import convert
from app.families.flux.encoder.encode import Encoder
from app.families.flux.encoder.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Encoder", "convert", "init_synthetic"]
