"""The LTX-Video family: every ``diffusers.AutoencoderKLLTXVideo`` decoder variant, and LTX-2.

``model.py`` the exact architecture (``Architecture.forward``: one pass over the clip),
``ltx2.py`` LTX-2's layers and spec, ``decode.py`` the served ``Decoder`` (both versions,
conditioning, memory estimate), ``streaming.py`` the same stages on frame chunks and spatial
tiles, ``convert.py`` the checkpoint layouts, ``synthetic.py`` the seeded weights (the CPU
fast path is ``Decoder.winograd_max_channels``).
"""

from app.families.ltx.decoder.convert import convert
from app.families.ltx.decoder.decode import Decoder
from app.families.ltx.decoder.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Decoder", "convert", "init_synthetic"]
