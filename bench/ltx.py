"""LTX-Video 0.9.1 decoder: the service's decoder vs diffusers' AutoencoderKLLTXVideo, same weights.

    python -m bench ltx [--frames 3] [--size 256] [--repeats 2] [--chunk 1] [--threads N]
                        [--only SUBSTR ...] [--force-bf16] [--device cpu|cuda]

The decoder is LTX-Video 0.9.1's (``CONFIG_091``: widths 256/512/1024 with 2x residual
upsamplers, so its resnets run at 1024 (mid), 512, 256, 128 channels; layers 8/7/6/5 from the
mid block up; timestep conditioning; noise injection in the mid block and the first two up
blocks; 754 M parameters, 3 GB in float32) with trained-like seeded weights
(``ltx.init_synthetic``). diffusers' model holds the very same tensors (built on the meta
device, ``load_state_dict(assign=True)``: no copy, no encoder). Both decode one seeded N(0,1)
latent ``[1, 128, frames, size/32, size/32]`` at timestep 0.05 with noise seed 0 (diffusers
draws its noise from the global RNG, seeded alike), so their outputs are comparable.

Every variant runs in a fresh subprocess (same weights, same threads): it builds its model,
warms up on a one-frame 2x2 latent, then times ``--repeats`` decodes (median) and reports the
peak memory of those decodes above what it held before them (CPU: the process's VmHWM after
resetting it, weights excluded, output included; CUDA: ``max_memory_allocated``). Its output
comes back through a temp file and is compared with diffusers fp32's (cosine, max-abs).
FLOPs are counted on the meta device (convs and GEMMs; no compute), and the rate is set
against this run's GEMM rate for the variant's dtype. bf16 variants are skipped when this
machine's bf16 GEMM runs below 1/4 of float32's (AVX2 CPUs emulate bf16; oneDNN refuses
bf16 convs there): ``--force-bf16`` runs them anyway.

Variants: diffusers fp32 (its default), fp32 with ``channels_last_3d``, bf16; the service's
decoder in one pass (``chunk_frames=0``; its fast path, and "exact": model.py's layers with
plain conv weights), in temporal chunks of ``--chunk`` latent frames
(exact; the full output is assembled), streamed (``iter_decode`` chunks turned into uint8
frames and dropped, as the MP4 path feeds ffmpeg: nothing is kept, so no cosine), and bf16.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from diffusers import AutoencoderKLLTXVideo

from app.families.ltx import decoder as ltx
from app.families.ltx.decoder.model import DEFAULTS
from app.media import mp4
from app.runtime import modes
from bench import common, table

CONFIG_091 = {
    **DEFAULTS,
    "decoder_block_out_channels": [256, 512, 1024],
    "decoder_layers_per_block": [5, 6, 7, 8],
    "decoder_spatio_temporal_scaling": [True, True, True],
    "decoder_inject_noise": [True, True, True, False],
    "upsample_residual": [True, True, True],
    "upsample_factor": [2, 2, 2],
    "timestep_conditioning": True,
}
TIMESTEP = 0.05  # LTX-Video 0.9.1's recommended decode_timestep
SEED = 0
PEER = "diffusers fp32"  # the oracle for the cosine column
Decode = Callable[[torch.Tensor], torch.Tensor | None]


def build_ours(seed: int = 0, config: dict | None = None) -> ltx.Decoder:
    """LTX-Video 0.9.1's decoder (or ``config``'s) with seeded weights, built without a random
    init of its 3 GB first."""
    config = config or CONFIG_091
    with torch.device("meta"):
        ours = ltx.Decoder(config)
    ours = ours.to_empty(device="cpu")
    c = ours.spec.latent_channels  # non-persistent buffers: to_empty left them uninitialized
    ours.latents_mean = torch.tensor(config.get("latents_mean") or [0.0] * c)
    ours.latents_std = torch.tensor(config.get("latents_std") or [1.0] * c)
    ltx.init_synthetic(ours, torch.Generator().manual_seed(seed))
    return ours.eval().requires_grad_(False)


def build_peer(ours: ltx.Decoder) -> AutoencoderKLLTXVideo:
    """diffusers' VAE holding ``ours``' tensors (shared), its encoder dropped."""
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in CONFIG_091.items()}
    with torch.device("meta"):
        ref = AutoencoderKLLTXVideo(
            latent_channels=cfg["latent_channels"],
            decoder_block_out_channels=cfg["decoder_block_out_channels"],
            decoder_layers_per_block=cfg["decoder_layers_per_block"],
            decoder_spatio_temporal_scaling=cfg["decoder_spatio_temporal_scaling"],
            decoder_inject_noise=cfg["decoder_inject_noise"],
            upsample_residual=cfg["upsample_residual"],
            upsample_factor=cfg["upsample_factor"],
            timestep_conditioning=True,
        )
    ref.decoder.load_state_dict(ours.state_dict(), strict=True, assign=True)
    ref.latents_mean, ref.latents_std = ours.latents_mean.clone(), ours.latents_std.clone()
    del ref.encoder
    return ref.eval().requires_grad_(False)


def latent(frames: int, size: int) -> torch.Tensor:
    cells = size // 32
    return torch.randn((1, 128, frames, cells, cells), generator=torch.Generator().manual_seed(1))


def variants(
    chunk: int, build: Callable[[], ltx.Decoder] = build_ours
) -> dict[str, Callable[[torch.device], Decode]]:
    """name -> make(device) -> decode(z). Each is built in its own process (``build``: the
    exact decoder they start from; ``bench.table`` passes one it built once)."""

    def peer(dtype: torch.dtype, channels_last: bool) -> Callable[[torch.device], Decode]:
        def make(device: torch.device) -> Decode:
            ref = build_peer(build()).to(device=device, dtype=dtype)
            if channels_last:
                ref = ref.to(memory_format=torch.channels_last_3d)

            def decode(z: torch.Tensor) -> torch.Tensor:
                temb = torch.full((z.shape[0],), TIMESTEP, device=device, dtype=dtype)
                torch.manual_seed(SEED)
                return ref.decode(z.to(device, dtype), temb).sample

            return decode

        return make

    def service(
        dtype: torch.dtype, chunk_frames: int, optimized: bool = True
    ) -> Callable[[torch.device], Decode]:
        def make(device: torch.device) -> Decode:
            model = modes.build(build(), device, modes.Mode(dtype, optimized))  # as the gate
            opts = {"timestep": TIMESTEP, "seed": SEED, "chunk_frames": chunk_frames}
            return lambda z: model.decode(z.to(device), **opts)

        return make

    def streamed(device: torch.device) -> Decode:
        model = modes.build(build(), device, modes.Mode(torch.float32))
        opts = {"timestep": TIMESTEP, "seed": SEED, "chunk_frames": chunk}

        def decode(z: torch.Tensor) -> None:
            for piece in model.iter_decode(z.to(device), **opts):
                mp4.to_uint8(model.to_unit(piece))  # what the MP4 path hands ffmpeg
            return None

        return decode

    return {
        PEER: peer(torch.float32, False),
        "diffusers fp32+CL3d": peer(torch.float32, True),
        "diffusers bf16": peer(torch.bfloat16, False),
        "service one pass": service(torch.float32, 0),
        "service exact one pass": service(torch.float32, 0, optimized=False),
        f"service chunked ({chunk})": service(torch.float32, chunk),
        f"service streamed ({chunk})": streamed,
        "service bf16 chunked": service(torch.bfloat16, chunk),
    }


# --- parent -------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        return _child(args)
    device = torch.device(args.device)
    print(f"machine: {common.machine()}")
    rates = {d: common.gemm_rate(d, device) for d in (torch.float32, torch.bfloat16)}
    print(
        "GEMM rate: " + ", ".join(f"{str(d)[6:]} {r / 1e9:.0f} GFLOP/s" for d, r in rates.items())
    )
    flops = count_flops(args.frames, args.size)
    frames_out = 1 + 8 * (args.frames - 1)
    print(
        f"LTX-Video 0.9.1 decoder, latent [1,128,{args.frames},{args.size // 32},"
        f"{args.size // 32}] -> {frames_out} frames of {args.size}x{args.size}: "
        f"{flops / 1e12:.2f} TFLOP (meta-device count)"
    )
    slow_bf16 = rates[torch.bfloat16] < rates[torch.float32] / 4 and not args.force_bf16
    if slow_bf16:
        print(
            f"bf16 GEMM {rates[torch.bfloat16] / 1e9:.1f} GFLOP/s < 1/4 of fp32: bf16 is emulated "
            "on this CPU (no AVX512-BF16/AMX): bf16 variants skipped (--force-bf16 runs them)"
        )
    spawn = partial(_spawn, args)
    common.run_children(
        list(variants(args.chunk)), args.only, slow_bf16, spawn, flops, rates, args.device, PEER
    )


def count_flops(frames: int, size: int) -> int:
    """FLOPs of one decode (convs and GEMMs), counted on the meta device: no compute."""
    with torch.device("meta"):
        model = ltx.Decoder(CONFIG_091)
    z = torch.empty((1, 128, frames, size // 32, size // 32), device="meta")
    return common.count_flops(lambda: model.decode(z, timestep=TIMESTEP, chunk_frames=0))


def _spawn(args: argparse.Namespace, name: str, out: Path) -> dict:
    options = ["--frames", str(args.frames), "--size", str(args.size), "--chunk", str(args.chunk)]
    return common.spawn_child("ltx", args, options, name, out)


@torch.inference_mode()
def _child(args: argparse.Namespace) -> None:
    make = variants(args.chunk)[args.child]
    common.child(make, torch.randn(1, 128, 1, 2, 2), latent(args.frames, args.size), args)


# --- the row of ``python -m bench all`` (bench/table.py) ------------------------------------
def table_setup(scale: str) -> table.Setup:
    """LTX-Video 0.9.1 at ``scale``: diffusers' fp32, fp32+CL3d and bf16, and the served path."""
    frames, size = {"tiny": (1, 32), "quick": (2, 128), "full": (3, 256)}[scale]
    build = table.once(build_ours)
    z = latent(frames, size)
    shape = f"0.9.1, {build().frames_out(frames)}x{size}x{size}"
    opts = {"timestep": TIMESTEP, "seed": SEED}
    return table.video(variants(1, build), table.PEER_NAMES, build, z, shape, opts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--frames", type=int, default=3, help="latent frames (default 3)")
    parser.add_argument("--size", type=int, default=256, help="output pixels per side")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=1, help="latent frames per chunk")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", nargs="*", help="substrings of variant names to run")
    parser.add_argument("--force-bf16", action="store_true", help="run bf16 even when slow")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)


if __name__ == "__main__":
    sys.exit("run as: python -m bench ltx ...")
