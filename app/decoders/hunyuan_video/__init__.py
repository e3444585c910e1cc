"""The ``hunyuan-video`` family: HunyuanVideo's causal 3-D VAE decoder.

``model.py`` the architecture (one pass over a window), ``decode.py`` the served ``Decoder``
(windows, tiles, memory estimate), ``tiling.py`` the reference's frame windows and spatial
tiles, ``fast.py`` the served copy's rewrites (upsamplers by output phase, Winograd),
``convert.py`` the checkpoint layouts, ``synthetic.py`` the seeded weights. Notes:
docs/families/hunyuan-video.md.
"""

from app.decoders.hunyuan_video.convert import convert
from app.decoders.hunyuan_video.decode import Decoder
from app.decoders.hunyuan_video.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Decoder", "convert", "init_synthetic"]
