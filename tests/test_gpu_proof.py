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
