"""The TAESD family: madebyollin's tiny preview decoders (TAESD, TAEF1, TAEF2).

``model.py`` the architecture, ``decode.py`` the served ``Decoder``, ``fast.py`` the served
copy's rewrites (upsample convs by output phase, in-place ReLUs), ``convert.py`` the
checkpoint layouts, ``synthetic.py`` the seeded weights.
"""

from app.decoders.taesd.convert import convert
from app.decoders.taesd.decode import Decoder
from app.decoders.taesd.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Decoder", "convert", "init_synthetic"]
