"""LTX-2 decoder: ours (one pass, chunked) vs diffusers' AutoencoderKLLTX2Video, float32 CPU.

python -m bench ltx2 [--frames 5] [--size 8] [--threads 1] [--repeat 2]: ``ltx2-tiny``'s
architecture with ``init_synthetic`` weights, loaded into both; prints seconds per decode and
cosine / max-abs against diffusers.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from app.decoders import ltx


def _timed(fn: Callable[[], torch.Tensor], repeat: int) -> tuple[torch.Tensor, float]:
    out = fn()
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    return out, (time.perf_counter() - start) / repeat


def run(args: argparse.Namespace) -> None:
    from diffusers import AutoencoderKLLTX2Video

    torch.set_num_threads(args.threads)
    config = ltx.SYNTHETIC["ltx2-tiny"]
    ours = ltx.Decoder(config).eval()
    ltx.init_synthetic(ours, torch.Generator().manual_seed(0))
    skip = ("version", "fps", "decode_timestep")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k not in skip}
    ref = AutoencoderKLLTX2Video(
        **kwargs, block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1)
    ).eval()
    ref.decoder.load_state_dict(ours.state_dict())
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(1, ours.latent_channels, args.frames, args.size, args.size, generator=gen)
    t = config["decode_timestep"]

    def reference() -> torch.Tensor:
        torch.manual_seed(0)
        with torch.no_grad():
            return ref.decode(z, torch.tensor([t])).sample

    expected, t_ref = _timed(reference, args.repeat)
    print(f"latent {list(z.shape)} -> {list(expected.shape)}; diffusers {t_ref:.3f} s")
    for chunk in (0, 1, 2):
        got, t_ours = _timed(
            lambda c=chunk: ours.decode(z, timestep=t, seed=0, chunk_frames=c), args.repeat
        )
        cos = torch.nn.functional.cosine_similarity(
            got.double().flatten(), expected.double().flatten(), 0
        ).item()
        err = (got - expected).abs().max().item()
        print(f"ours chunk_frames={chunk}: {t_ours:.3f} s, cos {cos:.12f}, max-abs {err:.1e}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=2)
