"""The ``hunyuan-video`` family: HunyuanVideo's causal 3-D VAE decoder.

``model.py`` the architecture (one pass over a window), ``decode.py`` the served ``Decoder``
(windows, tiles, memory estimate), ``tiling.py`` the reference's frame windows and spatial
tiles, ``fast.py`` the served copy's rewrites (upsamplers by output phase, Winograd),
``convert.py`` the checkpoint layouts, ``synthetic.py`` the seeded weights. Notes:
docs/families/hunyuan-video.md.
"""

from app.families.hunyuan_video.decoder.convert import convert
from app.families.hunyuan_video.decoder.decode import Decoder
from app.families.hunyuan_video.decoder.synthetic import SYNTHETIC, init_synthetic

__all__ = ["SYNTHETIC", "Decoder", "convert", "init_synthetic"]
