"""LTX-2 decoder: ours (one pass, chunked) vs diffusers' AutoencoderKLLTX2Video, float32 CPU.

python -m bench ltx2 [--frames 5] [--size 8] [--threads 1] [--repeat 2] [--released]:
``ltx2-tiny``'s architecture (``--released``: the released LTX-2 decoder's, ``ltx2.DEFAULTS``)
with ``init_synthetic`` weights, loaded into both; prints seconds per decode and cosine /
max-abs against diffusers.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from app.families.ltx import decoder as ltx
from app.families.ltx.decoder import ltx2
from bench import table

CONFIG = ltx.SYNTHETIC["ltx2-tiny"]
RELEASED = ltx2.DEFAULTS  # the released LTX-2 decoder's architecture
TIMESTEP = CONFIG["decode_timestep"]
SEED = 0


def build_ours(seed: int = 0, config: dict | None = None) -> ltx.Decoder:
    ours = ltx.Decoder(config or CONFIG).eval()
    ltx.init_synthetic(ours, torch.Generator().manual_seed(seed))
    return ours.requires_grad_(False)


def build_peer(ours: ltx.Decoder):
    """diffusers' AutoencoderKLLTX2Video holding ``ours``' decoder weights (its encoder tiny)."""
    from diffusers import AutoencoderKLLTX2Video

    skip = ("version", "fps", "decode_timestep")
    config = ours.config
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k not in skip}
    ref = AutoencoderKLLTX2Video(
        **kwargs, block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1)
    ).eval()
    ref.decoder.load_state_dict(ours.state_dict())
    return ref.requires_grad_(False)


def peer_decode(ref, z: torch.Tensor) -> torch.Tensor:
    """diffusers' decode at the timestep and noise seed ours is given (``SEED``)."""
    torch.manual_seed(SEED)
    with torch.no_grad():
        dtype = next(ref.parameters()).dtype
        return ref.decode(z.to(dtype), torch.tensor([TIMESTEP], dtype=dtype)).sample


def latent(ours: ltx.Decoder, frames: int, size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(1, ours.latent_channels, frames, size, size, generator=gen)


def _timed(fn: Callable[[], torch.Tensor], repeat: int) -> tuple[torch.Tensor, float]:
    out = fn()
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    return out, (time.perf_counter() - start) / repeat


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    ours = build_ours(config=RELEASED if args.released else None)
    ref = build_peer(ours)
    z = latent(ours, args.frames, args.size)
    expected, t_ref = _timed(lambda: peer_decode(ref, z), args.repeat)
    print(f"latent {list(z.shape)} -> {list(expected.shape)}; diffusers {t_ref:.3f} s")
    for chunk in (0, 1, 2):
        got, t_ours = _timed(
            lambda c=chunk: ours.decode(z, timestep=TIMESTEP, seed=SEED, chunk_frames=c),
            args.repeat,
        )
        cos = torch.nn.functional.cosine_similarity(
            got.double().flatten(), expected.double().flatten(), 0
        ).item()
        err = (got - expected).abs().max().item()
        print(f"ours chunk_frames={chunk}: {t_ours:.3f} s, cos {cos:.12f}, max-abs {err:.1e}")


# --- the row of ``python -m bench all`` (bench/table.py) ------------------------------------
def table_setup(scale: str) -> table.Setup:
    """LTX-2 at ``scale``: diffusers' fp32, fp32+CL3d and bf16, and the served path."""
    # the released architecture (a tiny one decodes in milliseconds: per-call costs only)
    frames, size = {"tiny": (2, 2), "quick": (2, 4), "full": (3, 8)}[scale]
    ours = build_ours(config=None if scale == "tiny" else RELEASED)
    z = latent(ours, frames, size)

    def peer(dtype: torch.dtype, channels_last: bool) -> Callable[[], table.Decode]:
        def make() -> table.Decode:
            ref = build_peer(ours).to(dtype=dtype)
            if channels_last:
                ref = ref.to(memory_format=torch.channels_last_3d)
            return lambda: peer_decode(ref, z)

        return make

    px = size * ours.spatial_scale
    arch = "ltx2-tiny arch" if scale == "tiny" else "LTX-2"
    return table.Setup(
        f"{arch}, {ours.frames_out(frames)}x{px}x{px}",
        {
            "fp32": peer(torch.float32, False),
            "fp32+CL3d": peer(torch.float32, True),
            "bf16": peer(torch.bfloat16, False),
        },
        table.served_path(ours, lambda m: m.decode(z, timestep=TIMESTEP, seed=SEED)),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--released", action="store_true", help="the released LTX-2 decoder")
