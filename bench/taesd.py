"""TAEF2 preview decode vs the full FLUX.2 decoder, same latent, same process, same threads.

    python -m bench taesd --sizes 512 1024 [--repeats 3] [--threads N] [--dtype float32]

For each output size both decoders decode the same seeded N(0,1) FLUX.2 latent
``[1, 32, size/8, size/8]``. The preview is TAEF2 with its real weights when
``../shared/weights/taef2/taef2_decoder.pth`` exists (else seeded synthetic weights of the
same shapes: the time does not depend on the values). The full decoder is the service's
``flux`` family decoder in the FLUX.2 configuration (``AutoencoderKLFlux2``'s defaults:
32 latent channels, post-quant conv, widths 128/256/512/512, 2 layers per block) with
seeded synthetic weights; TAEF2 previews exactly that latent space. Both run their exact
path (float32 unless ``--dtype``; no channels_last, bands or upsample rewrite: the FLUX fast
path is ``python -m bench flux``'s subject). FLOPs are counted on the meta device (no
compute; unlike a CPU count, that includes the mid-block attention, which torch's counter
misses in the CPU flash-attention kernel). Prints one markdown table.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from app.families.flux import decoder as flux
from app.families.flux.decoder.model import FLUX1_CONFIG
from app.families.taesd import decoder as taesd
from bench import common, table

SHARED_WEIGHTS = Path(__file__).resolve().parents[2] / "shared/weights/taef2/taef2_decoder.pth"
FLUX2_CONFIG = {
    **FLUX1_CONFIG,
    "latent_channels": 32,
    "use_post_quant_conv": True,
    "latent_bn": True,
    "scaling_factor": None,
    "shift_factor": None,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_preview(weights: Path | None) -> tuple[taesd.Decoder, str]:
    """TAEF2 from its real checkpoint if there is one, else seeded weights of the same shapes."""
    if weights is not None and weights.exists():
        config, state = taesd.convert(weights)
        decoder = taesd.Decoder(config)
        decoder.load_state_dict(state)
        source = f"real weights ({weights.name})"
    else:
        torch.manual_seed(0)
        decoder = taesd.Decoder({"variant": "taef2"})
        source = "synthetic weights (seed 0; ../shared absent)"
    return decoder.float().eval().requires_grad_(False), source


def build_pair(latent_channels: int = 16, seed: int = 0) -> tuple[taesd.Decoder, torch.nn.Module]:
    """diffusers' ``AutoencoderTiny`` (TAEF1's shape by default) with seeded He-scaled weights,
    and the service's decoder converted from its saved file, as ``python -m app import`` would."""
    from diffusers import AutoencoderTiny  # the peer: a test extra, only this function needs it

    ref = AutoencoderTiny(latent_channels=latent_channels)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.decoder.parameters():
            p.copy_(
                torch.randn(p.shape, generator=gen)
                * ((2 / p[0].numel()) ** 0.5 if p.ndim == 4 else 0.1)
            )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "decoder.safetensors"
        save_file({k: v.contiguous() for k, v in ref.decoder.state_dict().items()}, str(path))
        config, state = taesd.convert(path)
    ours = taesd.Decoder(config)
    ours.load_state_dict(state)
    del ref.encoder
    return ours.eval().requires_grad_(False), ref.eval().requires_grad_(False)


def build_full(seed: int = 0) -> flux.Decoder:
    decoder = flux.Decoder(FLUX2_CONFIG)
    flux.init_synthetic(decoder, torch.Generator().manual_seed(seed))
    return decoder.eval().requires_grad_(False)


@torch.inference_mode()
def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    preview, source = build_preview(None if args.synthetic else args.weights)
    full = build_full()
    print(f"machine: {common.machine()}")
    print(f"preview: TAEF2, {source}; full: FLUX.2-config flux.Decoder, synthetic weights (seed 0)")
    print(
        f"path: exact {args.dtype} on {device.type}, repeats {args.repeats}, warmup {args.warmup}"
    )
    rows = []
    for size in args.sizes:
        if size % 8:
            sys.exit(f"--sizes: {size} is not a multiple of 8 (the latent grid is 8x)")
        shape = (1, 32, size // 8, size // 8)
        z = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        row = [size]
        for name, decoder in (("TAEF2", preview), ("FLUX.2 full", full)):
            flops = common.meta_flops(decoder, shape)
            model = decoder.to(device=device, dtype=dtype)
            if dtype != torch.float32:
                model = model.to(memory_format=torch.channels_last)
            zd = z.to(device=device, dtype=dtype)
            seconds = common.time_it(
                lambda m=model, zd=zd: m.decode(zd), device, args.repeats, args.warmup
            )
            print(
                f"  {size}x{size} {name:12s} {seconds:8.3f} s  {flops / 1e9:9.1f} GFLOP"
                f"  {flops / seconds / 1e9:6.1f} GFLOP/s",
                flush=True,
            )
            row += [seconds, flops]
        rows.append(row)
    _report(rows)


def _report(rows: list[list]) -> None:
    print(
        "\n| size | TAEF2 s | TAEF2 GFLOP | TAEF2 GFLOP/s | FLUX.2 full s | FLUX.2 full GFLOP "
        "| full GFLOP/s | preview speedup | FLOP ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size, t_prev, f_prev, t_full, f_full in rows:
        print(
            f"| {size}x{size} | {t_prev:.3f} | {f_prev / 1e9:.1f} | {f_prev / t_prev / 1e9:.0f} "
            f"| {t_full:.2f} | {f_full / 1e9:.0f} | {f_full / t_full / 1e9:.0f} "
            f"| {t_full / t_prev:.1f}x | {f_full / f_prev:.1f}x |"
        )


# --- the row of ``python -m bench all`` (bench/table.py) ------------------------------------
def table_setup(scale: str) -> table.Setup:
    """TAEF1's shape at ``scale``: diffusers' ``AutoencoderTiny`` (fp32, fp32+CL, bf16+CL)
    holding the same weights, and the served path."""
    size = {"tiny": 32, "quick": 256, "full": 512}[scale]
    ours, ref = build_pair()
    z = torch.randn(1, 16, size // 8, size // 8, generator=torch.Generator().manual_seed(1))

    def peer(dtype: torch.dtype, channels_last: bool) -> Callable[[], table.Decode]:
        def make() -> table.Decode:
            model = copy.deepcopy(ref).to(dtype=dtype)
            if channels_last:
                model = model.to(memory_format=torch.channels_last)
            # diffusers returns [-1, 1]; the service (as upstream TAESD) [0, 1]
            return lambda: (model.decode(z.to(dtype)).sample + 1) / 2

        return make

    return table.Setup(
        f"TAEF1-shape {size}x{size}",
        {
            "fp32": peer(torch.float32, False),
            "fp32+CL": peer(torch.float32, True),
            "bf16+CL": peer(torch.bfloat16, True),
        },
        table.served_path(ours, lambda m: m.decode(z)),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed decodes before timing")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--weights", type=Path, default=SHARED_WEIGHTS, help="taef2_decoder.pth")
    parser.add_argument("--synthetic", action="store_true", help="ignore the real TAEF2 weights")


if __name__ == "__main__":
    sys.exit("run as: python -m bench taesd ...")
