"""A decoder family for the startup tests (``app.families.register("sleepy-flux", ...)`` by the
test; ``FAMILY`` its descriptor): FLUX's
decoder, whose plain-probe decode (batch 1, untiled) sleeps ``sleep_s`` in the modes its config
lists in ``slow_modes`` (``str(Mode)``: "float32", "float32 exact", "bfloat16",
"bfloat16 exact"), so a test can make one candidate mode slower than another on any CPU.
A bf16 copy computes with its weights in float32 (its output rounded to bf16): on a CPU that
emulates bf16 the tiny decode would take seconds, and a mode's time would not be the test's."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import Tensor

from app.families.descriptor import Family, Part
from app.families.flux.decoder import Decoder as FluxDecoder
from app.families.flux.decoder import convert, init_synthetic


class Decoder(FluxDecoder):
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
        dtype = self.conv_in.weight.dtype
        if dtype == torch.float32:
            return super().decode(z, tiled=tiled, **options)
        out = FluxDecoder.decode(self._float32, z.float(), tiled=tiled, **options)  # no 2nd sleep
        return out.to(dtype)

    def train(self, mode: bool = True) -> Decoder:
        """``eval()`` ends a served copy's build: a bf16 copy makes its float32 twin there, so
        that no mode's timed probe pays for it."""
        super().train(mode)
        weight = self.conv_in.weight
        if not mode and weight.dtype != torch.float32 and not weight.is_meta:
            object.__setattr__(self, "_float32", copy.deepcopy(self).float())  # not a submodule
        return self


FAMILY = Family("sleepy-flux", decoder=Part(Decoder, convert, init_synthetic))
