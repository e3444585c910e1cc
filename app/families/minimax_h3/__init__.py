"""The MiniMax-H3 family: the ViT3D video decoder, its image variant, and the 3-D CNN encoder
(``decoder/``, ``encoder/``; docs/families/minimax-h3.md)."""

from __future__ import annotations

from app.families.descriptor import Family, Part, recipes
from app.families.minimax_h3 import decoder, encoder

FAMILY = Family(
    key="minimax-h3",
    decoder=Part(decoder.Decoder, decoder.convert, decoder.init_synthetic),
    encoder=Part(encoder.Encoder, encoder.convert, encoder.init_synthetic),
    synthetic=recipes(decoder.SYNTHETIC, encoder.SYNTHETIC),
    bench={"minimax-h3": "bench.minimax_h3"},
)
