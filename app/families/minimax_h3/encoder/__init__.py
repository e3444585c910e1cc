"""The ``minimax-h3`` encoder family: ``AutoencoderKLMiniMaxH3``'s 3-D causal CNN encoder.

``model.py`` is the architecture, ``encode.py`` the family's ``Encoder`` (the reference's
clips and tiles, geometry, normalisation), ``convert.py`` the checkpoint layout,
``synthetic.py`` the seeded weights."""

from app.families.minimax_h3.encoder.convert import convert
from app.families.minimax_h3.encoder.encode import Encoder
from app.families.minimax_h3.encoder.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Encoder", "convert", "init_synthetic"]
