"""Compiled decodes for the warm-up shapes on a GPU.

``torch.compile`` fuses the normalizations, activations and adds between the convolutions,
which eager PyTorch runs as separate passes over memory. It compiles one graph per latent
shape, and a compile takes tens of seconds, so only the shapes named in
``VAE_WARMUP_SHAPES`` are compiled, after the service is ready, off the decode worker: requests
are served eagerly until a shape's graph has passed its gate. A request of any other shape runs
eagerly. ``VAE_COMPILE_CACHE_DIR`` keeps the compile caches for the next start on this host.
Each compiled shape is gated like the eager copy: its output on a seeded latent of that shape
is compared with a float32 copy of the reference on the same device, and it is served only if
the cosine reaches ``VAE_PARITY_MIN_COS``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from app.families.ops import cosine
from app.runtime import modes
from app.runtime.gate import PROBE_SEED
from app.runtime.parts import ServedPart

log = logging.getLogger("app.runtime.compiled")

Compiled = Callable[[Tensor], Tensor]


# how a decode is compiled: tests hold it (a compile that takes its time) or swap the backend
compiler: Callable[..., Compiled] = torch.compile
ARTIFACTS = "torch_compile_artifacts.bin"


def eligible(model: ServedPart, setting: str = "auto") -> bool:
    """Image decoders on their fast copy (video decoders stream chunk by chunk in Python):
    on a GPU (``VAE_COMPILE=auto``), or on any device (``on``)."""
    if setting == "off" or model.fallback or model.reference.is_video:
        return False
    return setting == "on" or model.device.type == "cuda"


def configure_cache(folder: Path | None) -> None:
    """Inductor's caches (and its FX graph cache) under ``folder``, and the cache artifacts a
    previous process saved there loaded, so a restart on this host reuses its compiles."""
    if folder is None:
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    artifacts = folder / ARTIFACTS
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    if artifacts.is_file() and load is not None:
        try:
            load(artifacts.read_bytes())
            log.info("loaded torch.compile cache artifacts from %s", artifacts)
        except Exception as exc:  # a cache of another torch: compile afresh
            log.warning("torch.compile cache artifacts %s not loaded: %s", artifacts, exc)


def save_cache(folder: Path | None) -> None:
    """torch.compile's cache artifacts of this process, written atomically under ``folder``."""
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    if folder is None or save is None:
        return
    saved = save()
    if not saved:
        return
    tmp = Path(folder) / f".{ARTIFACTS}.{os.getpid()}.tmp"
    tmp.write_bytes(saved[0])
    os.replace(tmp, Path(folder) / ARTIFACTS)


@torch.inference_mode()
def compile_shapes(model: ServedPart, shapes: list[tuple[int, ...]], min_cos: float) -> None:
    """Compile ``model``'s served decode for each shape and gate it against the float32 path;
    each that passes is swapped in (``model.compiled``) while eager decodes keep serving.
    Runs off the decode worker."""
    fast = model.fast
    fn: Compiled = compiler(lambda z: fast.decode(z, tiled=False), dynamic=False)
    exact = modes.build(model.reference, model.device, modes.Mode(torch.float32, False))
    for shape in shapes:
        z = torch.randn(shape, generator=torch.Generator().manual_seed(PROBE_SEED))
        z = z.to(model.device)
        t0 = time.perf_counter()
        got = fn(z)
        seconds = time.perf_counter() - t0
        if model.state is not None:
            model.state.phases["compile"] = round(model.state.phases.get("compile", 0) + seconds, 4)
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
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
