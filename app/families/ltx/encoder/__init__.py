"""The LTX-Video encoder family: ``AutoencoderKLLTXVideo`` (0.9.x) and ``AutoencoderKLLTX2Video``.

``model.py`` is the architecture (``EncoderNet``), ``encode.py`` the family's ``Encoder``
(tiles, geometry, normalisation), ``convert.py`` the checkpoint layout, ``synthetic.py`` the
seeded weights."""

from app.families.ltx.encoder.convert import convert
from app.families.ltx.encoder.encode import Encoder
from app.families.ltx.encoder.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Encoder", "convert", "init_synthetic"]
