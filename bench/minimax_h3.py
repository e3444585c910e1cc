"""MiniMax-H3 ViT3D decoder blocks: ours vs diffusers' block, same weights, same process.

    python -m bench minimax-h3 [--blocks 2] [--repeats 3] [--threads N] [--dtypes float32 bfloat16]

At the released width (dim 2048, 32 heads x 64, SwiGLU x4 with biases) over what one call of
the block stack sees for one 256-px tile of one temporal clip: 7 latent frames (a 5-token
chunk plus the 2-token overlap) x 16 x 16 cells + 4 register tokens + 1 zero token = 1797
tokens. ``--blocks`` blocks get trained-like seeded weights (``init_synthetic``); diffusers'
``MiniMaxH3VideoTransformerBlock`` holds the very same tensors (``load_state_dict(assign=True)``,
no copy), its bf16 variant pinned as ``from_pretrained(torch_dtype=bfloat16)`` pins it (norms and
layer scales float32, residual stream float32). Ours is the served copy of that dtype
(``modes.build``: the fast blocks of ``minimax_h3/fast.py``, the same pinning).

Prints one row per variant: median seconds per block, ratio against diffusers at the same
dtype, FLOPs per block (``torch.utils.flop_counter`` on the meta device, SDPA on its math
backend, since the counter does not see the CPU flash kernel; checked against the formula)
over the time against the machine's GEMM rate measured in this run (the better of a
measurement before and one after the blocks), the cosine of the blocks' residual update
(output minus input) against diffusers float32, and the largest difference from diffusers at
the same dtype. The variants take turns in every timed round (see ``common.interleaved``).
The full decoder runs 36 of these per tile clip.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable

import torch
from diffusers.models.autoencoders.autoencoder_kl_minimax_h3 import (
    MiniMaxH3VideoRotaryPosEmbed,
    MiniMaxH3VideoTransformerBlock,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from app.families.minimax_h3 import decoder as mm
from app.families.minimax_h3.decoder.model import DEFAULTS, rope_tables
from app.families.ops import cosine
from app.runtime import modes
from bench import common, table

GRID = (7, 16, 16)  # latent (t, h, w) of one tile clip: 5 + 2 tokens, 256 px / 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(blocks: int, seed: int = 0) -> mm.Decoder:
    """The released config cut to ``blocks`` blocks, with trained-like seeded weights."""
    decoder = mm.Decoder({**DEFAULTS, "decoder_num_layers": blocks})
    mm.init_synthetic(decoder, torch.Generator().manual_seed(seed))
    return decoder.eval().requires_grad_(False)


def peer_blocks(ours: torch.nn.ModuleList, cfg: dict) -> torch.nn.ModuleList:
    """diffusers' blocks holding the same tensors as ``ours`` (shared, not copied)."""
    heads, head_dim = cfg["decoder_num_attention_heads"], cfg["decoder_attention_head_dim"]
    out = torch.nn.ModuleList()
    for block in ours:
        with torch.device("meta"):
            peer = MiniMaxH3VideoTransformerBlock(
                dim=heads * head_dim,
                heads=heads,
                dim_head=head_dim,
                ffn_mult=cfg["decoder_ffn_mult"],
                eps=cfg["decoder_norm_eps"],
            )
        peer.load_state_dict(block.state_dict(), strict=True, assign=True)
        out.append(peer.eval().requires_grad_(False))
    return out


def stack(blocks: torch.nn.ModuleList, x: torch.Tensor, rope) -> Callable[[], torch.Tensor]:
    """The blocks applied in turn to ``x`` with ``rope`` (one call of a decoder's block stack).
    Ours run through their stack's own forward: the served ``FastBlocks`` hand their blocks a
    private copy of the residual stream, which the blocks update in place."""

    def fn() -> torch.Tensor:
        if type(blocks).forward is not torch.nn.ModuleList.forward:
            return blocks(x, rope)
        h = x
        for block in blocks:
            h = block(h, rope)
        return h

    return fn


def peer_rope(cfg: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' rotary tables for the tile clip, built as its ViT decoder builds them."""
    rope_dim = int(cfg["decoder_attention_head_dim"] * cfg["decoder_rope_dim_ratio"])
    rope = MiniMaxH3VideoRotaryPosEmbed(rope_dim, theta=cfg["decoder_rope_theta"]).to(device)
    grids = [
        2.0 * (torch.arange(0.5, n, dtype=torch.float32, device=device) / n) - 1.0 for n in GRID
    ]
    pos = torch.stack(torch.meshgrid(*grids, indexing="ij"), dim=-1).flatten(0, 2)[None]
    suffix = pos.new_zeros((1, cfg["decoder_num_register_tokens"] + 1, 3))
    return rope(torch.cat([pos, suffix], dim=1))


def count_block_flops(cfg: dict) -> int:
    """``torch.utils.flop_counter`` over one of our blocks on the meta device (shapes only, no
    arithmetic), SDPA on its math backend: the counter has no entry for the CPU flash kernel."""
    meta = torch.device("meta")
    with meta:
        block = mm.Decoder({**cfg, "decoder_num_layers": 1}).decoder.transformer_blocks[0]
        x = torch.empty(1, tokens(cfg), block.norm1.normalized_shape[0])
    rope_dim = int(cfg["decoder_attention_head_dim"] * cfg["decoder_rope_dim_ratio"])
    extra = cfg["decoder_num_register_tokens"] + 1
    rope = rope_tables(GRID, extra, rope_dim, cfg["decoder_rope_theta"], meta)
    with sdpa_kernel(SDPBackend.MATH):
        return common.count_flops(lambda: block(x, rope))


def tokens(cfg: dict) -> int:
    return GRID[0] * GRID[1] * GRID[2] + cfg["decoder_num_register_tokens"] + 1


def analytic_flops(cfg: dict) -> int:
    """FLOPs of one block over ``tokens(cfg)`` tokens: the linears and the two attention GEMMs."""
    n = tokens(cfg)
    dim = cfg["decoder_num_attention_heads"] * cfg["decoder_attention_head_dim"]
    inner = cfg["decoder_ffn_mult"] * dim
    linears = 4 * dim * dim + dim * 2 * inner + inner * dim  # q, k, v, out; SwiGLU in; out
    return 2 * n * linears + 4 * n * n * dim


@torch.inference_mode()
def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtypes = [DTYPES[d] for d in args.dtypes]
    decoder = build(args.blocks)
    cfg = decoder.config
    n = tokens(cfg)
    dim = cfg["decoder_num_attention_heads"] * cfg["decoder_attention_head_dim"]
    x = torch.randn(1, n, dim, generator=torch.Generator().manual_seed(1)).to(device)
    print(f"machine: {common.machine()}")
    rates = {d: common.gemm_rate(d, device) for d in dtypes}

    ours_rope = decoder.rope(GRID, device)
    theirs_rope = peer_rope(cfg, device)
    assert torch.allclose(ours_rope[0][:, 0], theirs_rope[0][0, :, 0], atol=1e-6)

    variants = {}
    for dtype in dtypes:
        model = decoder if dtype == torch.float32 else copy.deepcopy(decoder).to(dtype=dtype)
        peers = peer_blocks(model.to(device).decoder.transformer_blocks, cfg)
        served = modes.build(decoder, device, modes.Mode(dtype))  # the fast blocks
        name = str(dtype).removeprefix("torch.")
        variants[f"diffusers {name}"] = (dtype, stack(peers, x, theirs_rope))
        variants[f"service {name}"] = (
            dtype,
            stack(served.decoder.transformer_blocks, x, ours_rope),
        )

    flops = count_block_flops(cfg)
    print(
        f"one block over {n} tokens ({GRID[0]}x{GRID[1]}x{GRID[2]} cells + "
        f"{n - GRID[0] * GRID[1] * GRID[2]}): {flops / 1e9:.1f} GFLOP counted, "
        f"{analytic_flops(cfg) / 1e9:.1f} by formula"
    )

    outputs = {name: fn().float() for name, (_, fn) in variants.items()}  # also the warm-up
    times = common.interleaved(
        {name: fn for name, (_, fn) in variants.items()}, device, args.repeats
    )
    # the ceiling: the better of the GEMM rates measured before and after the blocks
    rates = {d: max(r, common.gemm_rate(d, device)) for d, r in rates.items()}
    print(
        "GEMM rate: " + ", ".join(f"{str(d)[6:]} {r / 1e9:.0f} GFLOP/s" for d, r in rates.items())
    )
    baseline = next(iter(outputs.values())) - x  # the first diffusers row's residual update
    rows = []
    for name, (dtype, _) in variants.items():
        seconds = times[name] / args.blocks
        cos = cosine(outputs[name] - x, baseline)
        rows.append([name, dtype, seconds, flops / seconds, flops / seconds / rates[dtype], cos])
        print(f"  {name:20s} {seconds:7.3f} s/block  cos {cos:.6f}", flush=True)
    _report(rows, outputs, args)


def _report(rows: list, outputs: dict, args: argparse.Namespace) -> None:
    peer = {r[1]: r[2] for r in rows if r[0].startswith("diffusers")}
    print(
        f"\n| variant | s / block | vs diffusers same dtype | x36 blocks s | TFLOP/s "
        f"| of GEMM rate | cos of update vs {rows[0][0]} | max abs vs diffusers same dtype |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, dtype, seconds, rate, frac, cos in rows:
        dname = str(dtype).removeprefix("torch.")
        same = (outputs[name] - outputs[f"diffusers {dname}"]).abs().max().item()
        print(
            f"| {name} | {seconds:.3f} | {peer[dtype] / seconds:.2f}x | {36 * seconds:.1f} "
            f"| {rate / 1e12:.3f} | {frac:.0%} | {cos:.6f} | {same:.1e} |"
        )
    print(
        f"\n(--blocks {args.blocks}, --repeats {args.repeats}: median of interleaved rounds "
        "after one warm-up call each)"
    )
    if any(r[4] > 1 for r in rows):
        print("warning: above 100% of the GEMM rate: the machine was loaded while it was measured")


# --- the row of ``python -m bench all`` (bench/table.py) ------------------------------------
def table_setup(scale: str) -> table.Setup:
    """One ViT3D block over one tile clip (``tiny``: 64 tokens): diffusers' block in fp32 and
    bf16 against the served copy's, compared on the block's residual update."""
    decoder = build(1)
    cfg = decoder.config
    dim = cfg["decoder_num_attention_heads"] * cfg["decoder_attention_head_dim"]
    n = tokens(cfg) if scale != "tiny" else 64
    x = torch.randn(1, n, dim, generator=torch.Generator().manual_seed(1))
    ours_rope = decoder.rope(GRID, table.CPU)
    theirs_rope = peer_rope(cfg, table.CPU)
    if scale == "tiny":  # the rope tables cut to n tokens
        ours_rope = tuple(t[:n] for t in ours_rope)
        theirs_rope = tuple(t[:, :n] for t in theirs_rope)

    def update(fn: table.Decode) -> table.Decode:
        return lambda: fn() - x  # a block's residual update: the output minus its input

    def peer(dtype: torch.dtype) -> Callable[[], table.Decode]:
        def make() -> table.Decode:
            model = decoder if dtype == torch.float32 else copy.deepcopy(decoder).to(dtype)
            blocks = peer_blocks(model.decoder.transformer_blocks, cfg)
            return update(stack(blocks, x, theirs_rope))  # x float32, as the bench

        return make

    def served(choose: table.Choose) -> tuple[str, table.Decode, int]:
        mode = choose(decoder)
        model = modes.build(decoder, table.CPU, mode)
        decode = update(stack(model.decoder.transformer_blocks, x, ours_rope))
        return str(mode), decode, common.own_bytes(model, decoder)

    return table.Setup(
        f"1 ViT3D block, {n} tokens",
        {"fp32": peer(torch.float32), "bf16": peer(torch.bfloat16)},
        served,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    sys.exit("run as: python -m bench minimax-h3 ...")
