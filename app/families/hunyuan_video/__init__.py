"""The ``hunyuan-video`` family: HunyuanVideo's causal 3-D VAE (``decoder/``, ``encoder/``;
docs/families/hunyuan-video.md)."""

from __future__ import annotations

from app.families.descriptor import Family, Part, previews_by_channels, recipes
from app.families.hunyuan_video import decoder, encoder

FAMILY = Family(
    key="hunyuan-video",
    decoder=Part(decoder.Decoder, decoder.convert, decoder.init_synthetic),
    encoder=Part(encoder.Encoder, encoder.convert, encoder.init_synthetic),
    synthetic=recipes(decoder.SYNTHETIC, encoder.SYNTHETIC),
    preview=previews_by_channels({16: "hunyuan-video"}),
    bench={"hunyuan-video": "bench.hunyuan_video"},
)
