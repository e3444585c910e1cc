"""The FLUX family: diffusers ``AutoencoderKL`` decoders (FLUX.1, SD3, SDXL/SD1.5) and FLUX.2's.

``model.py`` is the exact architecture, ``fast.py`` the gated fast path (``Decoder.optimize``
and banded execution), ``convert.py`` the checkpoint layouts and the seeded synthetic weights.
"""

from app.decoders.flux.convert import SYNTHETIC, convert, init_synthetic
from app.decoders.flux.model import Decoder

__all__ = ["SYNTHETIC", "Decoder", "convert", "init_synthetic"]
