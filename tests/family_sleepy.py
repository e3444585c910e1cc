"""A decoder family for the startup tests (``app.families.register("sleepy-flux", ...)`` by the
test; ``FAMILY`` its descriptor): FLUX's
decoder, whose plain-probe decode (batch 1, untiled) sleeps ``sleep_s`` in the modes its config
lists in ``slow_modes`` (``str(Mode)``: "float32", "float32 exact", "bfloat16",
"bfloat16 exact"), so a test can make one candidate mode slower than another on any CPU.
A bf16 copy computes with its weights in float32 (``tests.float32_twin``): a mode's time is the
test's on any CPU."""

from __future__ import annotations

import time
from typing import Any

from torch import Tensor

from app.families.descriptor import Family, Part
from app.families.flux.decoder import Decoder as FluxDecoder
from app.families.flux.decoder import convert, init_synthetic
from tests.float32_twin import Float32Twin


class Decoder(Float32Twin, FluxDecoder):
    optimized = False

    def optimize(self) -> None:
        super().optimize()
        self.optimized = True

    def mode_name(self) -> str:
        dtype = str(self.conv_in.weight.dtype).removeprefix("torch.")
        return dtype + ("" if self.optimized else " exact")

    def decode(self, z: Tensor, tiled: bool | None = None, **options: Any) -> Tensor:
        if tiled is False and z.shape[0] == 1 and self.mode_name() in self.config["slow_modes"]:
            time.sleep(self.config["sleep_s"])
        return super().decode(z, tiled=tiled, **options)


FAMILY = Family("sleepy-flux", decoder=Part(Decoder, convert, init_synthetic))
