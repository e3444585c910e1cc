"""The LTX-Video family: every ``AutoencoderKLLTXVideo`` variant and LTX-2's video VAE
(``decoder/``, ``encoder/``; docs/families/ltx.md)."""

from __future__ import annotations

from app.families.descriptor import Family, Part, recipes
from app.families.ltx import decoder, encoder


def preview_format(config: dict, channels: int) -> str | None:
    """LTX-Video's latents (LTX-2's latent space is not LTX-Video's: none published)."""
    return None if config.get("version") == "ltx2" or channels != 128 else "ltxv"


FAMILY = Family(
    key="ltx",
    decoder=Part(decoder.Decoder, decoder.convert, decoder.init_synthetic),
    encoder=Part(encoder.Encoder, encoder.convert, encoder.init_synthetic),
    synthetic=recipes(decoder.SYNTHETIC, encoder.SYNTHETIC),
    preview=preview_format,
    bench={"ltx": "bench.ltx", "ltx2": "bench.ltx2"},
)
