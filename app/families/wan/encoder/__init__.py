"""The ``wan`` encoder family: Wan 2.1, Wan 2.2 TI2V (``AutoencoderKLWan``) and Qwen-Image
(``AutoencoderKLQwenImage``).

``model.py`` is the architecture (the decoder family's causal layers and stream),
``encode.py`` the family's ``Encoder`` (frame chunks, tiles, geometry, normalisation),
``convert.py`` the checkpoint layout, ``synthetic.py`` the seeded weights."""

from app.families.wan.encoder.convert import convert
from app.families.wan.encoder.encode import Encoder
from app.families.wan.encoder.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Encoder", "convert", "init_synthetic"]
