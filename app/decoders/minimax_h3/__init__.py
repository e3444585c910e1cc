"""The MiniMax-H3 family: the ViT3D video decoder and its image variant.

``model.py`` is the exact architecture (``Decoder.forward`` decodes one tile clip),
``schedule.py`` the reference's tile and clip schedules that ``decode`` runs over it,
``convert.py`` the checkpoint layouts and the seeded synthetic weights, ``fast.py`` the
served copy's rewrites (behind the gate).
"""

from app.decoders.minimax_h3.convert import SYNTHETIC, convert, init_synthetic
from app.decoders.minimax_h3.model import Decoder

__all__ = ["SYNTHETIC", "Decoder", "convert", "init_synthetic"]
