"""The ``wan`` family: Wan 2.1, Wan 2.2 TI2V and Qwen-Image VAE decoders.

``model.py`` the architecture (and its exact temporal stream), ``decode.py`` the served
``Decoder`` (chunks, diffusers' spatial tiles, memory estimate), ``fast.py`` the served copy's
CPU layout, ``convert.py`` the checkpoint layouts, ``synthetic.py`` the seeded weights.
Notes: docs/families/wan.md.
"""

from app.families.wan.decoder.convert import convert
from app.families.wan.decoder.decode import Decoder
from app.families.wan.decoder.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Decoder", "convert", "init_synthetic"]
