"""Encoders: the service's vs diffusers' encode, same weights, same process, same threads.

    python -m bench encode [--quick] [--flux-size 256] [--taef2-size 512] [--repeats 3]

``--quick`` (about a minute on 2 loaded cores): 256 px / 512 px, 2 rounds.

FLUX.1: the full ``AutoencoderKL`` encoder config (16 ch, widths 128/256/512/512, seeded
trained-like weights) on a seeded ``[1, 3, S, S]`` image in [-1, 1]; the peer is diffusers'
``AutoencoderKL.encode`` holding the same weights. TAEF2: the real encoder when
``../shared/weights/taef2/taef2_encoder.pth`` exists (else seeded weights of its shapes).
diffusers' ``AutoencoderTiny`` cannot hold TAEF2's pool branch, so its peer row is the
pool-less TAEF1-shaped net with 32 latent channels (a little less work than TAEF2), and
the same-weights row is the checkpoint's own flat ``nn.Sequential`` (madebyollin's layout).
Variants take turns each round (``common.interleaved``), so a load change on a shared
machine lands on all alike. Prints markdown tables: median seconds, ratio vs the best peer,
cosine of the latent vs the service's exact float32 encode.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
from diffusers import AutoencoderKL, AutoencoderTiny
from torch import nn

from app.decoders.ops import cosine
from app.encoders import flux, taesd
from app.encoders.flux.model import ENCODER_CONFIG
from bench import common

TAEF2_WEIGHTS = Path(__file__).resolve().parents[2] / "shared/weights/taef2/taef2_encoder.pth"
CPU = torch.device("cpu")


def flux_pair(seed: int = 0) -> tuple[flux.Encoder, AutoencoderKL]:
    ours = flux.Encoder(ENCODER_CONFIG)
    flux.init_synthetic(ours, torch.Generator().manual_seed(seed))
    n = len(ENCODER_CONFIG["block_out_channels"])
    ref = AutoencoderKL(
        latent_channels=16,
        block_out_channels=tuple(ENCODER_CONFIG["block_out_channels"]),
        layers_per_block=ENCODER_CONFIG["layers_per_block"],
        use_quant_conv=False,
        use_post_quant_conv=False,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
    )
    ref.encoder.load_state_dict(ours.state_dict())
    del ref.decoder
    return ours.eval().requires_grad_(False), ref.eval().requires_grad_(False)


def taef2_encoders() -> tuple[taesd.Encoder, nn.Module | None, AutoencoderTiny, str]:
    """Ours, the checkpoint's flat Sequential (same weights; None without the file), the
    closest diffusers peer, and where the weights came from."""
    if TAEF2_WEIGHTS.exists():
        config, state = taesd.convert(TAEF2_WEIGHTS)
        ours = taesd.Encoder(config)
        ours.load_state_dict(state)
        flat = _flat_sequential(ours)
        source = f"real weights ({TAEF2_WEIGHTS.name})"
    else:
        ours = taesd.Encoder({"variant": "taef2"})
        taesd.init_synthetic(ours, torch.Generator().manual_seed(0))
        flat, source = None, "synthetic weights (seed 0; ../shared absent)"
    peer = AutoencoderTiny(latent_channels=32)
    del peer.decoder
    ours = ours.float().eval().requires_grad_(False)
    return ours, flat, peer.eval().requires_grad_(False), source


def _flat_sequential(ours: taesd.Encoder) -> nn.Module:
    """madebyollin's layout, built from the same modules: conv, blocks, (conv, blocks)*, conv;
    it reads [0, 1] pixels."""
    layers: list[nn.Module] = [ours.conv_in]
    for stage in ours.down:
        layers += [stage.conv] if stage.conv is not None else []
        layers += list(stage.blocks)
    return nn.Sequential(*layers, ours.conv_out)


def _table(title: str, times: dict[str, float], outputs: dict, exact: torch.Tensor) -> None:
    peers = {k: v for k, v in times.items() if k.startswith(("diffusers", "madebyollin"))}
    best = min(peers, key=peers.get)
    print(f"\n{title}\n| variant | median s | vs {best} | cos vs exact fp32 |")
    print("|---|---|---|---|")
    for name, seconds in times.items():
        cos = f"{cosine(outputs[name], exact):.6f}" if outputs[name] is not None else "-"
        print(f"| {name} | {seconds:.3f} | {peers[best] / seconds:.2f}x | {cos} |", flush=True)


def _channels_last(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).to(memory_format=torch.channels_last)


def bench_flux(size: int, repeats: int) -> None:
    ours, ref = flux_pair()
    x = torch.rand((1, 3, size, size), generator=torch.Generator().manual_seed(1)) * 2 - 1
    ref_cl, ours_cl = _channels_last(ref), _channels_last(ours)
    ours_fast = copy.deepcopy(ours)
    ours_fast.optimize()
    fns = {
        "diffusers fp32": lambda: ref.encode(x).latent_dist.parameters,
        "diffusers fp32+CL": lambda: ref_cl.encode(x).latent_dist.parameters,
        "service exact fp32": lambda: ours.moments(x),
        "service fp32+CL": lambda: ours_cl.moments(x),
        "service fast fp32 (Winograd)": lambda: ours_fast.moments(x),
    }
    outputs = {name: fn() for name, fn in fns.items()}  # also the warm-up
    times = common.interleaved(fns, CPU, repeats)
    _table(f"FLUX.1 encoder {size}x{size} (moments)", times, outputs, outputs["service exact fp32"])


def bench_taef2(size: int, repeats: int) -> None:
    ours, flat, peer, source = taef2_encoders()
    x = torch.rand((1, 3, size, size), generator=torch.Generator().manual_seed(1)) * 2 - 1
    ours_cl = _channels_last(ours)
    fns = {"diffusers AutoencoderTiny 32ch (no pool)": lambda: peer.encode(x).latents}
    if flat is not None:
        fns["madebyollin Sequential (same weights)"] = lambda: flat(x.add(1).div(2))
    fns["service exact fp32"] = lambda: ours.encode(x)
    fns["service fp32+CL"] = lambda: ours_cl.encode(x)
    outputs = {name: fn() for name, fn in fns.items()}
    outputs[next(iter(fns))] = None  # other weights: no cosine
    times = common.interleaved(fns, CPU, repeats)
    _table(f"TAEF2 encoder {size}x{size}, {source}", times, outputs, outputs["service exact fp32"])


@torch.inference_mode()
def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    load = " / ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"machine: {common.machine()}; load average {load} (a shared machine: see the spread)")
    repeats = 2 if args.quick else args.repeats
    bench_flux(256 if args.quick else args.flux_size, repeats)
    bench_taef2(512 if args.quick else args.taef2_size, repeats)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="FLUX.1 256 px, TAEF2 512 px, 2 rounds"
    )
    parser.add_argument("--flux-size", type=int, default=256)
    parser.add_argument("--taef2-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)


if __name__ == "__main__":
    sys.exit("run as: python -m bench encode ...")
