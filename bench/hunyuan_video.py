"""HunyuanVideo VAE decoder: the service's decoder vs diffusers' AutoencoderKLHunyuanVideo.

    python -m bench hunyuan-video [--frames 5] [--size 128] [--repeats 2] [--tiled]
                                  [--threads N] [--only SUBSTR ...] [--force-bf16]
                                  [--device cpu|cuda]

The decoder is the released one (16 latent channels, widths 512/512/256/128, 3 resnets per
up block, 32 norm groups, causal mid attention) with trained-like seeded weights
(``hunyuan_video.init_synthetic``). diffusers' model holds the very same tensors (built on
the meta device, ``load_state_dict(assign=True)``; no encoder). Both decode one seeded N(0,1)
latent of ``frames`` latent frames at ``size`` pixels, as diffusers does by default (frame
windows past 4 latent frames; ``--tiled``: spatial tiles too, ``enable_tiling()``'s).

Each variant runs in a fresh subprocess and is timed and measured as in ``bench.wan``
(median of ``--repeats`` after a warm-up; peak memory above the loaded model; output compared
with diffusers fp32's). Variants: diffusers fp32, diffusers bf16; the service's decoder
(``decode``), streamed (window by window, turned into uint8 frames and dropped, as the MP4
path does: no cosine), and bf16 (what the gate serves on a bf16 device).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLHunyuanVideo

from app.families.hunyuan_video import decoder as hunyuan_video
from app.media import mp4
from app.runtime import modes
from bench import common, table

CONFIG = {
    **hunyuan_video.SYNTHETIC["hunyuan-video-tiny"],
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
}
PEER = "diffusers fp32"
Decode = Callable[[torch.Tensor], torch.Tensor | None]


def build_ours(seed: int = 0) -> hunyuan_video.Decoder:
    ours = hunyuan_video.Decoder(CONFIG)
    hunyuan_video.init_synthetic(ours, torch.Generator().manual_seed(seed))
    return ours.eval().requires_grad_(False)


def build_peer(ours: hunyuan_video.Decoder) -> AutoencoderKLHunyuanVideo:
    """diffusers' VAE holding ``ours``' tensors (shared), its encoder dropped."""
    with torch.device("meta"):
        ref = AutoencoderKLHunyuanVideo(
            latent_channels=CONFIG["latent_channels"],
            block_out_channels=CONFIG["block_out_channels"],
            layers_per_block=CONFIG["layers_per_block"],
            norm_num_groups=CONFIG["norm_num_groups"],
        )
    state = {("" if k.startswith("post_quant") else "decoder.") + k: v
             for k, v in ours.state_dict().items()}  # fmt: skip
    missing, unexpected = ref.load_state_dict(state, strict=False, assign=True)
    assert not unexpected and all(k.startswith(("encoder.", "quant_conv.")) for k in missing)
    del ref.encoder, ref.quant_conv
    return ref.eval().requires_grad_(False)


def latent(frames: int, size: int) -> torch.Tensor:
    cells = size // CONFIG["spatial_compression_ratio"]
    shape = (1, CONFIG["latent_channels"], frames, cells, cells)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


def options(args: argparse.Namespace) -> dict[str, Any]:
    return {"tiled": True} if args.tiled else {}


def variants(
    args: argparse.Namespace, build: Callable[[], hunyuan_video.Decoder] = build_ours
) -> dict[str, Callable[[torch.device], Decode]]:
    """name -> make(device) -> decode(z). Each is built in its own process (``build``: the
    exact decoder they start from; ``bench.table`` passes one it built once)."""

    def peer(dtype: torch.dtype, channels_last: bool = False) -> Callable[[torch.device], Decode]:
        def make(device: torch.device) -> Decode:
            ref = build_peer(build()).to(device=device, dtype=dtype)
            if channels_last:
                ref = ref.to(memory_format=torch.channels_last_3d)
            if args.tiled:
                ref.enable_tiling()
            return lambda z: ref.decode(z.to(device, dtype)).sample

        return make

    def service(dtype: torch.dtype) -> Callable[[torch.device], Decode]:
        def make(device: torch.device) -> Decode:
            model = modes.build(build(), device, modes.Mode(dtype))
            return lambda z: model.decode(z.to(device), **options(args))

        return make

    def streamed(device: torch.device) -> Decode:
        model = modes.build(build(), device, modes.Mode(torch.float32))

        def decode(z: torch.Tensor) -> None:
            for piece in model.iter_decode(z.to(device), **options(args)):
                mp4.to_uint8(model.to_unit(piece))  # what the MP4 path hands ffmpeg
            return None

        return decode

    return {
        PEER: peer(torch.float32),
        "diffusers fp32+CL3d": peer(torch.float32, channels_last=True),
        "diffusers bf16": peer(torch.bfloat16),
        "service": service(torch.float32),
        "service streamed": streamed,
        "service bf16": service(torch.bfloat16),
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
    print(", ".join(f"{str(d)[6:]} GEMM {r / 1e9:.0f} GFLOP/s" for d, r in rates.items()))
    z = latent(args.frames, args.size)
    with torch.device("meta"):
        meta = hunyuan_video.Decoder(CONFIG)
    flops = common.count_flops(lambda: meta.decode(z.to("meta"), **options(args)))
    frames_out = meta.frames_out(args.frames)
    print(
        f"HunyuanVideo decoder, latent {list(z.shape)} -> {frames_out} frames of "
        f"{args.size}x{args.size}: {flops / 1e12:.2f} TFLOP (meta-device count)"
    )
    slow_bf16 = rates[torch.bfloat16] < rates[torch.float32] / 4 and not args.force_bf16
    if slow_bf16:
        print("bf16 is emulated on this CPU: bf16 variants skipped (--force-bf16 runs them)")
    spawn = partial(_spawn, args)
    common.run_children(
        list(variants(args)), args.only, slow_bf16, spawn, flops, rates, args.device, PEER
    )


def _spawn(args: argparse.Namespace, name: str, out: Path) -> dict:
    options = ["--frames", str(args.frames), "--size", str(args.size)]
    options += ["--tiled"] if args.tiled else []
    return common.spawn_child("hunyuan-video", args, options, name, out)


@torch.inference_mode()
def _child(args: argparse.Namespace) -> None:
    make = variants(args)[args.child]
    warm = torch.randn(1, CONFIG["latent_channels"], 1, 2, 2)
    common.child(make, warm, latent(args.frames, args.size), args)


# --- the row of ``python -m bench all`` (bench/table.py) ------------------------------------
def table_setup(scale: str) -> table.Setup:
    """HunyuanVideo at ``scale``: diffusers' fp32, fp32+CL3d and bf16, and the served path."""
    frames, size = {"tiny": (1, 16), "quick": (2, 64), "full": (5, 256)}[scale]
    build = table.once(build_ours)
    z = latent(frames, size)
    shape = f"{build().frames_out(frames)}x{size}x{size}"
    args = argparse.Namespace(tiled=False)
    return table.video(variants(args, build), table.PEER_NAMES, build, z, shape, {})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--frames", type=int, default=5, help="latent frames (default 5: 2 windows)"
    )
    parser.add_argument("--size", type=int, default=256, help="output pixels per side")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiled", action="store_true", help="spatial tiles (enable_tiling)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", nargs="*", help="substrings of variant names to run")
    parser.add_argument("--force-bf16", action="store_true", help="run bf16 even when slow")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)


if __name__ == "__main__":
    sys.exit("run as: python -m bench hunyuan-video ...")
