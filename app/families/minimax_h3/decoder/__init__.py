"""The MiniMax-H3 family: the ViT3D video decoder and its image variant.

``model.py`` the exact architecture (``Architecture.forward`` decodes one tile clip),
``decode.py`` the served ``Decoder`` (both variants, the tile and clip schedules of
``schedule.py`` over ``forward``, memory estimate), ``fast.py`` the served copy's rewrites
(behind the gate), ``convert.py`` the checkpoint layouts, ``synthetic.py`` the seeded weights.
"""

from app.families.minimax_h3.decoder.convert import convert
from app.families.minimax_h3.decoder.decode import Decoder
from app.families.minimax_h3.decoder.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Decoder", "convert", "init_synthetic"]
