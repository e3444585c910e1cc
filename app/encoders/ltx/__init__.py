"""The LTX-Video encoder family: ``AutoencoderKLLTXVideo`` (0.9.x) and ``AutoencoderKLLTX2Video``.

``model.py`` is the architecture (``EncoderNet``), ``encode.py`` the family's ``Encoder``
(tiles, geometry, normalisation), ``convert.py`` the checkpoint layout, ``synthetic.py`` the
seeded weights."""

from app.encoders.ltx.convert import convert
from app.encoders.ltx.encode import Encoder
from app.encoders.ltx.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Encoder", "convert", "init_synthetic"]
