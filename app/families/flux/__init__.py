"""The FLUX family: diffusers ``AutoencoderKL`` VAEs (FLUX.1, SD3, SDXL/SD1.5) and FLUX.2's
``AutoencoderKLFlux2``: ``decoder/`` and ``encoder/`` (docs/families.md)."""

from __future__ import annotations

from app.families.descriptor import Family, Part, recipes
from app.families.flux import decoder, encoder

# the flux family's 4- and 16-channel VAEs told apart by their scaling_factor (SDXL's, SD3's)
_BY_SCALING = {(4, 0.13025): "sdxl", (16, 1.5305): "sd3"}
_BY_CHANNELS = {4: "sd1.5", 16: "flux1", 32: "flux2"}


def preview_format(config: dict, channels: int) -> str | None:
    """SD1.5 / SDXL (4 channels), FLUX.1 / SD3 (16), FLUX.2 (32) latents."""
    scaling = config.get("scaling_factor")
    return _BY_SCALING.get((channels, scaling)) or _BY_CHANNELS.get(channels)


FAMILY = Family(
    key="flux",
    decoder=Part(decoder.Decoder, decoder.convert, decoder.init_synthetic),
    encoder=Part(encoder.Encoder, encoder.convert, encoder.init_synthetic),
    synthetic=recipes(decoder.SYNTHETIC, encoder.SYNTHETIC),
    preview=preview_format,
    bench={"flux": "bench.flux"},
)
