"""The ``minimax-h3`` encoder family: ``AutoencoderKLMiniMaxH3``'s 3-D causal CNN encoder.

``model.py`` is the architecture, ``encode.py`` the family's ``Encoder`` (the reference's
clips and tiles, geometry, normalisation), ``convert.py`` the checkpoint layout,
``synthetic.py`` the seeded weights."""

from app.encoders.minimax_h3.convert import convert
from app.encoders.minimax_h3.encode import Encoder
from app.encoders.minimax_h3.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Encoder", "convert", "init_synthetic"]
