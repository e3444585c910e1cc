"""The TAESD family: madebyollin's tiny preview VAEs (TAESD, TAEF1, TAEF2; ``decoder/``,
``encoder/``; docs/families/taesd.md). None is baked: a preview decoder is only worth serving
with its trained weights (``python -m app import taesd``); the seeded one is for the proofs."""

from __future__ import annotations

from app.families.descriptor import Family, Part, Recipe, previews_by_channels
from app.families.taesd import decoder, encoder

SEEDED = {"variant": "taef1"}  # the released TAEF1 topology, seeded weights

FAMILY = Family(
    key="taesd",
    decoder=Part(decoder.Decoder, decoder.convert, decoder.init_synthetic),
    encoder=Part(encoder.Encoder, encoder.convert, encoder.init_synthetic),
    synthetic={"taesd-seeded": Recipe(dict(SEEDED), dict(SEEDED), baked=False)},
    # TAESD, TAEF1, TAEF2: the latents of SD1.5, FLUX.1 and FLUX.2
    preview=previews_by_channels({4: "sd1.5", 16: "flux1", 32: "flux2"}),
    bench={"taesd": "bench.taesd"},
)
