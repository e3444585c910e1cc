"""A test family's bf16 (or fp16) copy that computes with its weights in float32.

On a CPU that emulates bf16 (no bf16 kernels: a bf16 convolution takes 10x to 600x float32's
time, docs/BENCHMARKS.md) a tiny test decoder's bf16 gate takes seconds to a minute, and what
a test checks (the gate's mechanics, a mode's measured time) does not depend on bf16
arithmetic. The copy keeps its bf16 weights (what the runtime built, cast and laid out), and
decodes with a float32 twin of them, made at ``eval()`` (the end of a served copy's build, so
that no timed probe pays for it); its output is rounded to the copy's dtype."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn


class Float32Twin(nn.Module):
    """Mix in before the family's decoder (``class Decoder(Float32Twin, FluxDecoder)``): a copy
    in another dtype decodes with the family's own ``decode`` on its float32 twin (what the
    test's class adds around ``super().decode``, a sleep or a wrong tile, runs once)."""

    twin: nn.Module | None = None

    @property
    def copy_dtype(self) -> torch.dtype:
        """The copy's own dtype (what its output is rounded to)."""
        return next(self.parameters()).dtype

    def train(self, mode: bool = True) -> Float32Twin:
        super().train(mode)
        if not mode and self.copy_dtype != torch.float32 and not next(self.parameters()).is_meta:
            object.__setattr__(self, "twin", None)  # a second eval() copies no twin of a twin
            object.__setattr__(self, "twin", copy.deepcopy(self).float())  # not a submodule
        return self

    def decode(self, z: Tensor, **options: Any) -> Tensor:
        if self.twin is None:
            return super().decode(z, **options)
        family_decode = super(Float32Twin, self.twin).decode  # the class after this mixin's
        return family_decode(z.float(), **options).to(self.copy_dtype)
