"""The ``hunyuan-video`` encoder family: ``AutoencoderKLHunyuanVideo``'s encoder half.

``model.py`` is the architecture (the decoder family's causal layers), ``encode.py`` the
family's ``Encoder`` (temporal windows, tiles, geometry, scaling), ``convert.py`` the
checkpoint layout, ``synthetic.py`` the seeded weights."""

from app.encoders.hunyuan_video.convert import convert
from app.encoders.hunyuan_video.encode import Encoder
from app.encoders.hunyuan_video.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Encoder", "convert", "init_synthetic"]
