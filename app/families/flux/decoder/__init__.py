"""The FLUX family: diffusers ``AutoencoderKL`` decoders (FLUX.1, SD3, SDXL/SD1.5) and FLUX.2's.

``model.py`` the architecture, ``decode.py`` the served ``Decoder`` (row bands, memory
estimate), ``fast.py`` the gated fast path, ``convert.py`` the checkpoint layouts,
``synthetic.py`` the seeded weights (docs/decoders.md).
"""

from app.families.flux.decoder.convert import convert
from app.families.flux.decoder.decode import Decoder
from app.families.flux.decoder.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Decoder", "convert", "init_synthetic"]
