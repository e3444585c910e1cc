"""The ``wan`` family: Wan 2.1, Wan 2.2 TI2V and Qwen-Image VAEs (``decoder/``, ``encoder/``;
docs/families/wan.md)."""

from __future__ import annotations

from app.families.descriptor import Family, Part, previews_by_channels, recipes
from app.families.wan import decoder, encoder

FAMILY = Family(
    key="wan",
    decoder=Part(decoder.Decoder, decoder.convert, decoder.init_synthetic),
    encoder=Part(encoder.Encoder, encoder.convert, encoder.init_synthetic),
    synthetic=recipes(decoder.SYNTHETIC, encoder.SYNTHETIC),
    # Wan 2.1 and Qwen-Image (ComfyUI previews both as Wan21); Wan 2.2 has none published
    preview=previews_by_channels({16: "wan2.1"}),
    bench={"wan": "bench.wan"},
)
