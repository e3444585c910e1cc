"""Encoders: the service's vs diffusers' encode, same weights, same process, same threads.

    python -m bench encode [--quick] [--repeats 2] [--threads N] [--only FAMILY ...]
                           [--force-bf16]

One row per family with an encoder (``setups()``, from the family descriptors), each measured
in its own subprocess (its models freed before the next family loads): the family's peer
setup in ``PEERS`` where it has one, else its served encode alone (``served_only``: its first
embedded model with an encoder, seeded, encoding its gate probe image; no peer, no ratio).
diffusers is measured as a user would set it up: float32, float32 with channels_last
(``channels_last_3d`` for video), bf16 (skipped when this machine's bf16 GEMM runs below 1/4
of float32's: emulated); its fastest setting is the row's peer. The service side is our exact
float32 encoder and the copy the service serves on this machine (chosen as every part is:
``gate.probes_for`` + ``selection.choose``, every candidate mode timed on the probe, the
fastest that passes the gate; the row names it and each candidate's probe time). The cosine
is our exact encode's moments against diffusers float32's (same weights: the check that the
row compares like with like), and the served copy's against our exact one's. Variants take
turns each round (``common.interleaved``), so a load change on a shared machine lands on all
alike.

Shapes (``--quick`` / default): FLUX.1 (full ``AutoencoderKL`` encoder: 16 ch, widths
128/256/512/512, seeded trained-like weights) 256 / 512 px; TAEF2 (the ``taesd`` row)
512 / 1024 px with the
real encoder when ``../shared/weights/taef2/taef2_encoder.pth`` exists (diffusers'
``AutoencoderTiny`` cannot hold TAEF2's pool branch: the same-weights peer is the
checkpoint's own flat ``nn.Sequential``, madebyollin's layout, and diffusers' pool-less
32-channel ``AutoencoderTiny`` is listed beside it, not taken as the peer); the video
families with diffusers' default (released) encoder configs and seeded default-init weights:
LTX 0.9.0 9x128x128 / 17x256x256, Wan 2.1 5x128x128 / 9x256x256, HunyuanVideo 5x64x64 /
9x128x128, MiniMax-H3 one 17-frame clip at 64x64 / 128x128.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from diffusers import AutoencoderKL, AutoencoderTiny
from torch import nn

from app.config import Settings
from app.families import families, family
from app.families.encoder import VAEEncoder
from app.families.flux import encoder as flux
from app.families.flux.encoder.model import ENCODER_CONFIG
from app.families.ops import cosine
from app.families.taesd import encoder as taesd
from app.runtime import gate, modes, selection
from bench import common

TAEF2_WEIGHTS = Path(__file__).resolve().parents[2] / "shared/weights/taef2/taef2_encoder.pth"
CPU = torch.device("cpu")
Encode = Callable[[], torch.Tensor]
EMULATED = "skipped: bf16 emulated"
NO_PEER = "no peer"  # a family without a peer setup here: its served encode alone
MIN_COS = Settings.model_fields["parity_min_cos"].default
SAME_WEIGHTS = "madebyollin Sequential (same weights)"


@dataclass
class Setup:
    """One family at one shape: our exact encoder, its input, diffusers' settings."""

    shape: str
    ours: VAEEncoder
    x: torch.Tensor
    # setting -> make() -> encode() (moments); empty: no peer (``served_only``)
    peers: dict[str, Callable[[], Encode]]
    # settings listed beside the peers but not comparable (other weights): no cosine, no peer
    others: dict[str, Callable[[], Encode]] = field(default_factory=dict)


def _seeded(cls: type, **config) -> nn.Module:
    torch.manual_seed(0)
    return cls(**config).eval().requires_grad_(False)


def _frozen(module: nn.Module) -> nn.Module:
    return module.float().eval().requires_grad_(False)


def _input(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(1)) * 2 - 1


def _peer_settings(ref: nn.Module, x: torch.Tensor, encode, video: bool) -> dict:
    """diffusers' three settings of one model: fp32, fp32 channels-last, bf16."""
    layout = "CL3d" if video else "CL"

    def channels_last() -> Encode:
        model = copy.deepcopy(ref)
        if video:
            model = common.channels_last_3d(model)
        else:
            model = model.to(memory_format=torch.channels_last)
        return lambda: encode(model, x)

    def bf16() -> Encode:
        model = copy.deepcopy(ref).to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        return lambda: encode(model, xb)

    return {
        "fp32": lambda: lambda: encode(ref, x),
        f"fp32+{layout}": channels_last,
        "bf16": bf16,
    }


def _moments(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.encode(x).latent_dist.parameters


# --- families -------------------------------------------------------------------------------
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
    return _frozen(ours), _frozen(ref)


def flux_setup(quick: bool) -> Setup:
    size = 256 if quick else 512
    ours, ref = flux_pair()
    x = _input((1, 3, size, size))
    return Setup(f"FLUX.1 {size}x{size}", ours, x, _peer_settings(ref, x, _moments, False))


def taef2_encoders() -> tuple[taesd.Encoder, nn.Module | None, AutoencoderTiny, str]:
    """Ours, the checkpoint's flat Sequential (same weights; None without the file), the
    closest diffusers model, and where the weights came from."""
    if TAEF2_WEIGHTS.exists():
        config, state = taesd.convert(TAEF2_WEIGHTS)
        ours = taesd.Encoder(config)
        ours.load_state_dict(state)
        flat = _flat_sequential(ours)
        source = "real weights"
    else:
        ours = taesd.Encoder({"variant": "taef2"})
        taesd.init_synthetic(ours, torch.Generator().manual_seed(0))
        flat, source = None, "synthetic weights (../shared absent)"
    peer = AutoencoderTiny(latent_channels=32)
    del peer.decoder
    return _frozen(ours), flat, _frozen(peer), source


def _flat_sequential(ours: taesd.Encoder) -> nn.Module:
    """madebyollin's layout, built from the same modules: conv, blocks, (conv, blocks)*, conv;
    it reads [0, 1] pixels."""
    layers: list[nn.Module] = [ours.conv_in]
    for stage in ours.down:
        layers += [stage.conv] if stage.conv is not None else []
        layers += list(stage.blocks)
    return nn.Sequential(*layers, ours.conv_out)


def taef2_setup(quick: bool) -> Setup:
    size = 512 if quick else 1024
    ours, flat, peer, source = taef2_encoders()
    x = _input((1, 3, size, size))
    peers = {}
    if flat is not None:
        flat_cl = copy.deepcopy(flat).to(memory_format=torch.channels_last)
        peers[SAME_WEIGHTS] = lambda: lambda: flat(x.add(1).div(2))
        peers[SAME_WEIGHTS + " +CL"] = lambda: lambda: flat_cl(x.add(1).div(2))
    others = {
        "diffusers AutoencoderTiny 32ch (no pool)": lambda: lambda: peer.encode(x).latents,
    }
    return Setup(f"TAEF2 {size}x{size}, {source}", ours, x, peers, others)


def _video_pair(ours_module, config: dict, ref: nn.Module) -> VAEEncoder:
    """Our encoder of ``config`` holding ``ref``'s encoder tensors (strict: same weights)."""
    ours = ours_module.Encoder(config)
    prefixes = ("encoder.", "quant_conv.")
    ours.load_state_dict({k: v for k, v in ref.state_dict().items() if k.startswith(prefixes)})
    return _frozen(ours)


def _video_setup(label: str, module, cls, extra: dict, shape: tuple[int, ...]) -> Setup:
    ref = _seeded(cls, **extra)
    ours = _video_pair(module, module.encode.DEFAULTS, ref)
    ref.decoder = None  # the peer encodes only: its decoder's memory back
    x = _input(shape)
    t, h, w = shape[2:]
    return Setup(f"{label} {t}x{h}x{w}", ours, x, _peer_settings(ref, x, _moments, True))


def ltx_setup(quick: bool) -> Setup:
    from diffusers import AutoencoderKLLTXVideo

    from app.families.ltx import encoder as ltx

    tiny_decoder = dict(decoder_block_out_channels=(8, 8, 8, 8))
    shape = (1, 3, 9, 128, 128) if quick else (1, 3, 17, 256, 256)
    return _video_setup("LTX 0.9.0", ltx, AutoencoderKLLTXVideo, tiny_decoder, shape)


def wan_setup(quick: bool) -> Setup:
    from diffusers import AutoencoderKLWan

    from app.families.wan import encoder as wan

    shape = (1, 3, 5, 128, 128) if quick else (1, 3, 9, 256, 256)
    return _video_setup("Wan 2.1", wan, AutoencoderKLWan, {"decoder_base_dim": 8}, shape)


def hunyuan_video_setup(quick: bool) -> Setup:
    from diffusers import AutoencoderKLHunyuanVideo

    from app.families.hunyuan_video import encoder as hunyuan_video

    shape = (1, 3, 5, 64, 64) if quick else (1, 3, 9, 128, 128)
    return _video_setup("HunyuanVideo", hunyuan_video, AutoencoderKLHunyuanVideo, {}, shape)


def minimax_h3_setup(quick: bool) -> Setup:
    from diffusers import AutoencoderKLMiniMaxH3

    from app.families.minimax_h3 import encoder as minimax_h3

    tiny_decoder = dict(
        decoder_num_layers=1,
        decoder_num_attention_heads=1,
        decoder_attention_head_dim=8,
        decoder_num_register_tokens=1,
        decoder_ffn_mult=1,
    )
    shape = (1, 3, 17, 64, 64) if quick else (1, 3, 17, 128, 128)
    return _video_setup("MiniMax-H3", minimax_h3, AutoencoderKLMiniMaxH3, tiny_decoder, shape)


# the families measured against a peer, by family key (the rest: ``served_only``)
PEERS: dict[str, Callable[[bool], Setup]] = {
    "flux": flux_setup,
    "taesd": taef2_setup,
    "ltx": ltx_setup,
    "wan": wan_setup,
    "hunyuan-video": hunyuan_video_setup,
    "minimax-h3": minimax_h3_setup,
}


def setups() -> dict[str, Callable[[bool], Setup]]:
    """Family key -> setup(quick), for every family with an encoder (the descriptors)."""
    return {
        key: PEERS.get(key, partial(served_only, key))
        for key, described in families().items()
        if described.encoder is not None
    }


def served_only(key: str, quick: bool) -> Setup:
    """A family without a peer setup: its first embedded model with an encoder (seeded, as
    ``bake --synthetic`` writes it) on its gate probe image; the probe's size whatever
    ``quick``."""
    described = family(key)
    recipes = [(n, r) for n, r in described.synthetic.items() if r.encoder_config is not None]
    if described.encoder is None or not recipes:
        raise ValueError(f"family {key!r} embeds no encoder to bench")
    name, recipe = recipes[0]
    ours = described.encoder.module(dict(recipe.encoder_config))
    described.encoder.init_synthetic(ours, torch.Generator().manual_seed(0))
    ours = _frozen(ours)
    x = gate.probes_for(ours).plain
    return Setup(f"{name}, probe {'x'.join(map(str, x.shape))}", ours, x, {})


# --- one family's row -----------------------------------------------------------------------
def served_copy(ours: VAEEncoder) -> tuple[nn.Module, selection.Selection]:
    """What the service serves for ``ours`` on this CPU with ``VAE_DTYPE=auto`` (the copy, and
    how it was chosen): chosen as every part is, the exact encoder where no candidate passes."""
    probes = gate.probes_for(ours)
    candidates = modes.candidate_modes("auto", CPU)
    chosen = selection.choose(ours.family, probes, CPU, candidates, MIN_COS, repeats=2)
    return (chosen.chosen.copy if chosen.passed else ours), chosen


@torch.inference_mode()
def measure(family: str, quick: bool, repeats: int, skip_bf16: bool) -> dict:
    """Median seconds of every diffusers setting (or why skipped), of our exact encode and
    of the served copy; the fastest peer; the cosines of ours vs the first peer (fp32)."""
    setup = setups()[family](quick)
    fns: dict[str, Encode] = {}
    peers: dict[str, float | str] = {}
    for setting, make in setup.peers.items():
        if skip_bf16 and "bf16" in setting:
            peers[setting] = EMULATED
        else:
            fns[setting] = make()
    others = {name: make() for name, make in setup.others.items()}
    ours = setup.ours
    active, chosen = served_copy(ours)
    fns["service exact fp32"] = lambda: ours.moments(setup.x)
    if active is not ours:
        x = setup.x.to(next(active.parameters()).dtype)
        fns["service served"] = lambda: active.moments(x)
    fns.update(others)
    outputs = {name: fn().float() for name, fn in fns.items()}  # also the warm-ups
    times = common.interleaved(fns, CPU, repeats)
    service = {k: times.pop(k) for k in list(times) if k.startswith("service")}
    other_times = {k: times.pop(k) for k in others}
    peers.update(times)
    timed = {k: v for k, v in peers.items() if isinstance(v, float)}
    best = min(timed, key=timed.get) if timed else None
    ours_name = "service served" if "service served" in service else "service exact fp32"
    exact = outputs["service exact fp32"]
    reference = outputs.get(next(iter(setup.peers), ""))
    return {
        "family": family,
        "shape": setup.shape,
        "peers": peers,
        "others": other_times,
        "best": best or NO_PEER,
        "best_s": timed.get(best),
        "service": service,
        "served": str(chosen.chosen.mode) if chosen.passed else f"{modes.EXACT} (fallback)",
        "served_why": chosen.why,
        "candidates": {str(c.mode): c.probe_seconds for c in chosen.candidates},
        "ours_s": service[ours_name],
        "ratio": timed[best] / service[ours_name] if best else None,
        "cos": cosine(exact, reference) if reference is not None else None,
        "cos_served": cosine(outputs[ours_name], exact),
    }


def format_table(rows: list[dict]) -> str:
    lines = [
        "| family | shape | peer's best | its s | ours exact s | served s (mode) | vs best "
        "| cos exact vs peer fp32 | cos served vs exact | peer settings measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['family']} | - | - | - | - | - | - | - | - | failed: {r['error']} |"
            )
            continue
        settings = "; ".join(
            f"{k} {v:.2f} s" if isinstance(v, float) else f"{k} {v}"
            for k, v in {**r["peers"], **r["others"]}.items()
        )
        lines.append(
            f"| {r['family']} | {r['shape']} | {r['best']} | {_num(r['best_s'], '.2f')} "
            f"| {r['service']['service exact fp32']:.2f} | {r['ours_s']:.2f} ({r['served']}) "
            f"| {_num(r['ratio'], '.2f', 'x')} | {_num(r['cos'], '.7f')} "
            f"| {r['cos_served']:.7f} | {settings or 'none (no peer setup)'} |"
        )
        probes = ", ".join(
            f"{mode} {'-' if t is None else f'{t:.3f} s'}" for mode, t in r["candidates"].items()
        )
        notes.append(f"{r['family']}: served {r['served']} ({r['served_why']}); probe: {probes}")
    return "\n".join(lines + [""] + notes)


def _num(x: float | None, spec: str, unit: str = "") -> str:
    """A number of the table, blank where the row has none (no peer: no ratio, no cosine)."""
    return "" if x is None else f"{x:{spec}}{unit}"


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        return print(json.dumps(measure(args.child, args.quick, args.repeats, args.skip_bf16)))
    from bench.table import machine_line

    load = " / ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"{machine_line()}; load average {load}")
    rates = {d: common.gemm_rate(d, CPU) for d in (torch.float32, torch.bfloat16)}
    emulated = rates[torch.bfloat16] < rates[torch.float32] / 4
    print(
        "GEMM rate: "
        + ", ".join(f"{str(d)[6:]} {r / 1e9:.0f} GFLOP/s" for d, r in rates.items())
        + ("  (bf16 emulated: its diffusers settings skipped)" if emulated else "")
    )
    print(format_table(rows(args, emulated)))
    print(f"load average after: {' / '.join(f'{v:.1f}' for v in os.getloadavg())}")


def rows(args: argparse.Namespace, emulated: bool) -> list[dict]:
    """Each family's row from its own subprocess (``--child``)."""
    out = []
    for name in args.only or setups():
        command = ["encode", "--child", name]
        command += ["--repeats", str(args.repeats)] + (["--quick"] if args.quick else [])
        if args.threads:
            command += ["--threads", str(args.threads)]
        if emulated and not args.force_bf16:
            command.append("--skip-bf16")
        out.append({"family": name, **common.bench_child(command)})
        r = out[-1]
        note = r.get("error") or (
            f"{r['ratio']:.2f}x of {r['best']}" if r["ratio"] is not None else NO_PEER
        )
        print(f"  encode {name:14s} {note}", file=sys.stderr, flush=True)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small shapes (see the docstring)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--only", nargs="*", choices=list(setups()), help="families to run")
    parser.add_argument("--force-bf16", action="store_true", help="run bf16 even when emulated")
    parser.add_argument("--skip-bf16", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)


if __name__ == "__main__":
    sys.exit("run as: python -m bench encode ...")
