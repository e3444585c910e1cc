"""The TAESD family's encoders: madebyollin's tiny encoders (TAESD, TAEF1, TAEF2).
``model.py`` is the architecture, ``encode.py`` the ``Encoder`` (latent, tiles),
``convert.py`` the checkpoint layouts, ``synthetic.py`` the seeded weights."""

from app.families.taesd.encoder.convert import convert
from app.families.taesd.encoder.encode import Encoder
from app.families.taesd.encoder.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Encoder", "convert", "init_synthetic"]
