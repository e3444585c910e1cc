"""Parity gate of every family's embedded models on this machine's device (GPU check).

    python scripts/gpu_gate.py [--device cuda]

For each SYNTHETIC model of each family: build it with its seeded weights, then for every
candidate path (bf16, float32 ...) make the resident fast copy and run the startup gate
against the float32 CPU path. Prints one markdown row per (model, path).
"""

from __future__ import annotations

import argparse
import time

import torch

from app import fastpath
from app.decoders import FAMILIES, family_module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print("| model | family | path | gate cosine | passes 0.9999 | probe decode ms |")
    print("|---|---|---|---|---|---|")
    for family in FAMILIES:
        module = family_module(family)
        for name, config in getattr(module, "SYNTHETIC", {}).items():
            reference = module.Decoder(config)
            module.init_synthetic(reference, torch.Generator().manual_seed(0))
            reference.eval().requires_grad_(False)
            for path in fastpath.candidate_paths("auto", device):
                fast = fastpath.make_fast(reference, device, path)
                gate = fastpath.parity_gate(fast, reference, 0.9999)
                ms = _probe_ms(fast, reference, device)
                print(
                    f"| {name} | {family} | {device.type} {path} | {gate.cosine:.6f} | "
                    f"{gate.passed} | {ms:.1f} |",
                    flush=True,
                )
                del fast


@torch.inference_mode()
def _probe_ms(fast, reference, device: torch.device) -> float:
    probe = reference.probe_latent(torch.Generator().manual_seed(0)).to(device)
    fast.decode(probe)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fast.decode(probe)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000


if __name__ == "__main__":
    main()
