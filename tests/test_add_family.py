"""A family is added as one folder and one line (issue 37.1): a copy of the project gets a
throwaway family (taesd's package copied under a new name, its bench rows dropped: a new
family has no bench module) and one line in ``app.families.PACKAGES``; nothing else is
edited. The copy then bakes it, serves it (decode, encode, preview), benches it and gates it
in the GPU proof, each through its real command line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests

from tests.faulty import serve_process

ROOT = Path(__file__).resolve().parents[1]
NAME, PACKAGE = "throwaway-seeded", "throwaway"


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    """The project's code with the throwaway family added as one folder and one line."""
    repo = tmp_path_factory.mktemp("repo")
    for folder in ("app", "bench", "scripts"):
        shutil.copytree(ROOT / folder, repo / folder, ignore=shutil.ignore_patterns("__pycache__"))
    family = repo / "app" / "families" / PACKAGE
    shutil.copytree(ROOT / "app" / "families" / "taesd", family)
    for path in family.rglob("*.py"):
        text = path.read_text().replace("app.families.taesd", f"app.families.{PACKAGE}")
        text = text.replace('key="taesd"', f'key="{PACKAGE}"').replace("taesd-seeded", NAME)
        path.write_text(re.sub(r"\n    bench=\{[^}]*\},", "", text))
    packages = repo / "app" / "families" / "__init__.py"
    text = packages.read_text()
    packages.write_text(text.replace('    "wan",\n)', f'    "wan",\n    "{PACKAGE}",\n)'))
    assert packages.read_text() != text, "the one line was not added"
    return repo


def run(repo: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(repo), "VAE_DEVICE": "cpu", "OUT": str(repo / "out")}
    return subprocess.run(
        [sys.executable, *args], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_new_family_is_baked_and_served(copy, tmp_path):
    store = copy / "store"
    baked = run(
        copy, "-m", "app", "bake", "--synthetic", "--only", NAME, "--models-dir", str(store)
    )
    assert baked.returncode == 0 and f"baked {NAME} ({PACKAGE}, decoder+encoder)" in baked.stdout, (
        baked.stdout + baked.stderr
    )
    env = {"PYTHONPATH": str(copy), "VAE_DTYPE": "float32"}
    with serve_process(store, tmp_path / "serve.log", root=copy, **env) as (url, _):
        (model,) = requests.get(f"{url}/models", timeout=30).json()["models"]
        assert model["family"] == PACKAGE and model["encoder"]["family"] == PACKAGE
        z = np.random.default_rng(0).standard_normal((1, 16, 8, 8), dtype=np.float32)
        query = {"shape": json.dumps(list(z.shape)), "dtype": "float32"}
        headers = {"Content-Type": "tensor/binary"}
        for output in ("pil", "preview"):
            r = requests.post(
                f"{url}/decode/{NAME}",
                params={**query, "output_type": output},
                data=z.tobytes(),
                headers=headers,
                timeout=60,
            )
            assert r.status_code == 200 and r.content[:4] == b"\x89PNG", (output, r.text[:300])
        pixels = np.zeros((1, 3, 64, 64), np.float32)
        r = requests.post(
            f"{url}/encode/{NAME}",
            params={"shape": json.dumps(list(pixels.shape)), "dtype": "float32"},
            data=pixels.tobytes(),
            headers=headers,
            timeout=60,
        )
        assert r.status_code == 200 and json.loads(r.headers["shape"]) == [1, 16, 8, 8], r.text


def test_the_new_family_is_benched_and_in_the_gpu_proof(copy):
    bench = run(copy, "-m", "bench", "all", "--quick", "--only", PACKAGE, "--repeats", "1")
    assert bench.returncode == 0 and PACKAGE in bench.stdout, bench.stdout + bench.stderr
    cmd = ["scripts/gpu_proof.py", "--device", "cpu", "--quick", "--only", "gate"]
    proof = run(copy, *cmd, "--models", NAME)
    assert proof.returncode == 0, proof.stdout[-3000:] + proof.stderr[-3000:]
    report = json.loads((copy / "out" / "gpu_proof.json").read_text())
    assert {row["family"] for row in report["gate"]} == {PACKAGE}
