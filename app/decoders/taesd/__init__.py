"""The TAESD family: madebyollin's tiny preview decoders (TAESD, TAEF1, TAEF2).

``model.py`` the architecture, ``decode.py`` the served ``Decoder``, ``convert.py`` the
checkpoint layouts, ``synthetic.py`` the seeded weights (no fast path: the decoder is already
tiny; its optimized copy differs only in dtype and memory format).
"""

from app.decoders.taesd.convert import convert
from app.decoders.taesd.decode import Decoder
from app.decoders.taesd.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Decoder", "convert", "init_synthetic"]
