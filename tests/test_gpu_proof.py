"""The GPU proof script runs anywhere in CPU mode and writes its report in the agreed schema
(on a GPU machine it is run whole: docs/gpu/)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_proof_runs_on_the_cpu_and_writes_its_report(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": str(Path(os.sys.executable))}
    cmd = [
        "bash",
        "scripts/gpu_proof.sh",
        "--device",
        "cpu",
        "--quick",
        "--only",
        "encoder",
        "gate",
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_proof.json").read_text())
    assert {"device", "gate", "flux", "e2e", "ok"} <= set(report) and report["ok"] is True
    families = {row["family"] for row in report["gate"]}
    assert {"flux", "ltx", "minimax-h3"} <= families
    for row in report["gate"]:
        assert {"model", "family", "dtype", "cos", "psnr_db", "passed"} <= set(row)
        assert row["passed"] and row["cos"] >= 0.9999
        assert {"batch1", "batch2", "denormalized"} <= set(row["checks"])
    assert (tmp_path / "gpu_proof.md").read_text().startswith("# GPU proof")


def test_kernel_profile_accounts_a_decode_by_kind_and_renders():
    """The profile section's accounting, run on the CPU (aten ops stand in for kernels)."""
    import importlib.util

    import torch

    from app.decoders import flux
    from tests.live import TINY_FLUX

    spec = importlib.util.spec_from_file_location("gpu_proof", ROOT / "scripts" / "gpu_proof.py")
    proof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(proof)
    model = flux.Decoder(TINY_FLUX["flux-tiny"])
    flux.init_synthetic(model, torch.Generator().manual_seed(0))
    z = torch.randn(1, model.latent_channels, 8, 8)
    kernels = proof._kernel_profile(lambda x: model.decode(x), z)
    kinds = kernels["by_kind_ms"]
    assert kinds["convolution"] > 0 and kinds.get("other", 0) > 0
    assert abs(sum(kinds.values()) - kernels["total_ms"]) < 1e-6
    assert kernels["top"] and all(t["calls"] >= 1 for t in kernels["top"])
    report = {
        "device": "cpu", "machine": "m", "started": "t", "quick": True, "ok": True,
        "gate": [], "flux": [], "e2e": [], "ladder": [], "l4": [], "notes": [], "errors": [],
        "profile": {"size": 64, "flops": 1e9, "gemm_tflops": 1.0,
                    "rows": [{"layout": "NCHW", "ms": 1.0, "tflops": 1.0, "kernels": kernels}]},
    }  # fmt: skip
    text = proof.markdown(report)
    assert "kernel by kernel" in text and kernels["top"][0]["name"][:20] in text
