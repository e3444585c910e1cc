"""Compiled decodes for the warm-up shapes on a GPU.

``torch.compile`` fuses the normalizations, activations and adds between the convolutions,
which eager PyTorch runs as separate passes over memory. It compiles one graph per latent
shape, and a compile takes tens of seconds, so only the shapes named in
``VAE_WARMUP_SHAPES`` are compiled, at startup; a request of any other shape runs eagerly.
Each compiled shape is gated like the eager copy: its output on a seeded latent of that shape
is compared with a float32 copy of the reference on the same device, and it is served only if
the cosine reaches ``VAE_PARITY_MIN_COS``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor

from app.decoders.ops import cosine
from app.runtime import modes
from app.runtime.gate import PROBE_SEED
from app.runtime.registry import ServedModel

log = logging.getLogger("app.runtime.compiled")

Compiled = Callable[[Tensor], Tensor]


def eligible(model: ServedModel) -> bool:
    """Image decoders served on a GPU: video decoders stream chunk by chunk in Python."""
    return model.device.type == "cuda" and not model.fallback and not model.reference.is_video


@torch.inference_mode()
def compile_shapes(model: ServedModel, shapes: list[tuple[int, ...]], min_cos: float) -> None:
    """Compile ``model``'s served decode for each shape; keep those that pass the gate."""
    fast = model.fast
    fn: Compiled = torch.compile(lambda z: fast.decode(z, tiled=False), dynamic=False)
    exact = modes.build(model.reference, model.device, modes.Mode(torch.float32, False))
    for shape in shapes:
        z = torch.randn(shape, generator=torch.Generator().manual_seed(PROBE_SEED))
        z = z.to(model.device)
        t0 = time.perf_counter()
        got = fn(z)
        seconds = time.perf_counter() - t0
        cos = cosine(got, exact.decode(z, tiled=False))
        log.info(
            "model %s: compiled %s in %.1f s, cosine %.7f vs float32",
            model.name,
            shape,
            seconds,
            cos,
        )
        if cos >= min_cos:
            model.compiled[shape] = fn
        else:
            log.warning("model %s: compiled %s fails the gate; it runs eagerly", model.name, shape)
    del exact
    torch.cuda.empty_cache()
