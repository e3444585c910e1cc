"""The TAESD family: madebyollin's tiny preview decoders (TAESD, TAEF1, TAEF2).

``model.py`` the architecture, ``decode.py`` the served ``Decoder``, ``fast.py`` the served
copy's rewrites (upsample convs by output phase, in-place ReLUs), ``convert.py`` the
checkpoint layouts, ``synthetic.py`` the seeded weights.
"""

from app.families.taesd.decoder.convert import convert
from app.families.taesd.decoder.decode import Decoder
from app.families.taesd.decoder.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Decoder", "convert", "init_synthetic"]
