"""The LTX-Video family: every ``diffusers.AutoencoderKLLTXVideo`` decoder variant.

``model.py`` is the exact architecture (``Decoder.forward``: one pass over the clip),
``streaming.py`` runs the same stages on frame chunks and spatial tiles (``decode``,
``iter_decode``), ``convert.py`` the checkpoint layouts and the seeded synthetic weights.
"""

from app.decoders.ltx.convert import SYNTHETIC, convert, init_synthetic
from app.decoders.ltx.model import Decoder

__all__ = ["SYNTHETIC", "Decoder", "convert", "init_synthetic"]
