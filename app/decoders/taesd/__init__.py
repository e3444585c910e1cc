"""The TAESD family: madebyollin's tiny preview decoders (TAESD, TAEF1, TAEF2).

``model.py`` is the architecture, ``convert.py`` the checkpoint layouts (no fast path: the
decoder is already tiny; its optimized copy differs only in dtype and memory format).
"""

from app.decoders.taesd.convert import convert
from app.decoders.taesd.model import Decoder

__all__ = ["Decoder", "convert"]
