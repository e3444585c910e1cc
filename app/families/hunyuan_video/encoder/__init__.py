"""The ``hunyuan-video`` encoder family: ``AutoencoderKLHunyuanVideo``'s encoder half.

``model.py`` is the architecture (the decoder family's causal layers), ``encode.py`` the
family's ``Encoder`` (temporal windows, tiles, geometry, scaling), ``convert.py`` the
checkpoint layout, ``synthetic.py`` the seeded weights."""

from app.families.hunyuan_video.encoder.convert import convert
from app.families.hunyuan_video.encoder.encode import Encoder
from app.families.hunyuan_video.encoder.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Encoder", "convert", "init_synthetic"]
