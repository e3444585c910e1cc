"""Wan VAE decoder: the service's decoder vs diffusers' AutoencoderKLWan, same weights.

    python -m bench wan [--variant wan2.1|wan2.2] [--frames 3] [--size 256] [--repeats 2]
                        [--chunk 1] [--threads N] [--only SUBSTR ...] [--force-bf16]
                        [--device cpu|cuda]

The decoder is the released Wan 2.1 one (``wan2.1``: 16 latent channels, widths 384/192/96,
3 resnets per up block, 73 M decoder parameters; Qwen-Image's is the same) or Wan 2.2 TI2V's
(``wan2.2``: 48 channels, widths 1024/512/256, residual up blocks, 2x2 patch) with
trained-like seeded weights (``wan.init_synthetic``). diffusers' model holds the very same
tensors (built on the meta device, ``load_state_dict(assign=True)``; no encoder). Both
decode one seeded N(0,1) latent of ``frames`` latent frames at ``size`` pixels.

Each variant runs in a fresh subprocess and is timed and measured as in ``bench.ltx``
(median of ``--repeats`` after a warm-up; peak memory above the loaded model; output compared
with diffusers fp32's). Variants: diffusers fp32 (its default: one latent frame per call),
diffusers bf16; the service's decoder in one pass (``chunk_frames=0``), in chunks of
``--chunk`` latent frames, streamed (chunks turned into uint8 frames and dropped, as the MP4
path does: no cosine), and bf16 chunked (what the gate serves on a bf16 device).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan

from app.families.wan import decoder as wan
from app.media import mp4
from app.runtime import modes
from bench import common, table

CONFIGS = {
    "wan2.1": {
        **wan.SYNTHETIC["wan2.1-tiny"],
        "decoder_base_dim": 96,
        "num_res_blocks": 2,
    },
    "wan2.2": {
        **wan.SYNTHETIC["wan2.2-tiny"],
        "decoder_base_dim": 256,
        "num_res_blocks": 2,
    },
}
PEER = "diffusers fp32"
Decode = Callable[[torch.Tensor], torch.Tensor | None]


def build_ours(variant: str, seed: int = 0) -> wan.Decoder:
    ours = wan.Decoder(CONFIGS[variant])
    wan.init_synthetic(ours, torch.Generator().manual_seed(seed))
    return ours.eval().requires_grad_(False)


def build_peer(variant: str, ours: wan.Decoder) -> AutoencoderKLWan:
    """diffusers' VAE holding ``ours``' tensors (shared), its encoder dropped."""
    c = CONFIGS[variant]
    with torch.device("meta"):
        ref = AutoencoderKLWan(
            base_dim=c["decoder_base_dim"],
            z_dim=c["z_dim"],
            dim_mult=c["dim_mult"],
            num_res_blocks=c["num_res_blocks"],
            temperal_downsample=c["temperal_downsample"],
            is_residual=c["is_residual"],
            patch_size=c["patch_size"],
            in_channels=c["out_channels"],
            out_channels=c["out_channels"],
            scale_factor_spatial=c["spatial_compression_ratio"],
            latents_mean=c["latents_mean"],
            latents_std=c["latents_std"],
        )
    state = {("" if k.startswith("post_quant") else "decoder.") + k: v
             for k, v in ours.state_dict().items()}  # fmt: skip
    missing, unexpected = ref.load_state_dict(state, strict=False, assign=True)
    assert not unexpected and all(k.startswith(("encoder.", "quant_conv.")) for k in missing)
    del ref.encoder, ref.quant_conv
    return ref.eval().requires_grad_(False)


def latent(variant: str, frames: int, size: int) -> torch.Tensor:
    c = CONFIGS[variant]
    cells = size // c["spatial_compression_ratio"]
    shape = (1, c["z_dim"], frames, cells, cells)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


def variants(
    variant: str, chunk: int, build: Callable[[], wan.Decoder] | None = None
) -> dict[str, Callable[[torch.device], Decode]]:
    """name -> make(device) -> decode(z). Each is built in its own process (``build``: the
    exact decoder they start from; ``bench.table`` passes one it built once)."""
    build = build or (lambda: build_ours(variant))

    def peer(dtype: torch.dtype, channels_last: bool = False) -> Callable[[torch.device], Decode]:
        def make(device: torch.device) -> Decode:
            ref = build_peer(variant, build()).to(device=device, dtype=dtype)
            if channels_last:
                ref = common.channels_last_3d(ref)
            return lambda z: ref.decode(z.to(device, dtype)).sample

        return make

    def service(dtype: torch.dtype, chunk_frames: int) -> Callable[[torch.device], Decode]:
        def make(device: torch.device) -> Decode:
            model = modes.build(build(), device, modes.Mode(dtype))
            return lambda z: model.decode(z.to(device), chunk_frames=chunk_frames)

        return make

    def streamed(device: torch.device) -> Decode:
        model = modes.build(build(), device, modes.Mode(torch.float32))

        def decode(z: torch.Tensor) -> None:
            for piece in model.iter_decode(z.to(device), chunk_frames=chunk):
                mp4.to_uint8(model.to_unit(piece))  # what the MP4 path hands ffmpeg
            return None

        return decode

    return {
        PEER: peer(torch.float32),
        "diffusers fp32+CL3d": peer(torch.float32, channels_last=True),
        "diffusers bf16": peer(torch.bfloat16),
        "service one pass": service(torch.float32, 0),
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
    print(", ".join(f"{str(d)[6:]} GEMM {r / 1e9:.0f} GFLOP/s" for d, r in rates.items()))
    z = latent(args.variant, args.frames, args.size)
    with torch.device("meta"):
        meta = wan.Decoder(CONFIGS[args.variant])
    flops = common.count_flops(lambda: meta.decode(z.to("meta"), chunk_frames=0))
    frames_out = meta.frames_out(args.frames)
    print(
        f"{args.variant} decoder, latent {list(z.shape)} -> {frames_out} frames of "
        f"{args.size}x{args.size}: {flops / 1e12:.2f} TFLOP (meta-device count)"
    )
    slow_bf16 = rates[torch.bfloat16] < rates[torch.float32] / 4 and not args.force_bf16
    if slow_bf16:
        print("bf16 is emulated on this CPU: bf16 variants skipped (--force-bf16 runs them)")
    spawn = partial(_spawn, args)
    common.run_children(
        list(variants(args.variant, args.chunk)),
        args.only,
        slow_bf16,
        spawn,
        flops,
        rates,
        args.device,
        PEER,
    )


def _spawn(args: argparse.Namespace, name: str, out: Path) -> dict:
    options = ["--variant", args.variant, "--frames", str(args.frames)]
    options += ["--size", str(args.size), "--chunk", str(args.chunk)]
    return common.spawn_child("wan", args, options, name, out)


@torch.inference_mode()
def _child(args: argparse.Namespace) -> None:
    make = variants(args.variant, args.chunk)[args.child]
    warm = torch.randn(1, CONFIGS[args.variant]["z_dim"], 1, 2, 2)
    common.child(make, warm, latent(args.variant, args.frames, args.size), args)


# --- the row of ``python -m bench all`` (bench/table.py) ------------------------------------
def table_setup(scale: str) -> table.Setup:
    """Wan 2.1 at ``scale``: diffusers' fp32, fp32+CL3d and bf16, and the served path."""
    frames, size = {"tiny": (1, 32), "quick": (2, 128), "full": (3, 256)}[scale]
    build = table.once(lambda: build_ours("wan2.1"))
    z = latent("wan2.1", frames, size)
    shape = f"2.1, {build().frames_out(frames)}x{size}x{size}"
    return table.video(variants("wan2.1", 1, build), table.PEER_NAMES, build, z, shape, {})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variant", choices=list(CONFIGS), default="wan2.1")
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
    sys.exit("run as: python -m bench wan ...")
