"""``pip install ./clients/python`` into a fresh venv: no torch, no service dependencies, and
the installed client decodes against the live service (run by the service's venv, here).

The caller's working directory holds a package of its own named ``app``, as a sampler's may:
the client must neither need nor shadow it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from vae_client import Client

CLIENT_SOURCE = Path(__file__).resolve().parents[1]
# The client's closure is httpx's and numpy's; none of these may come along.
SERVICE_ONLY = {"torch", "fastapi", "uvicorn", "starlette", "pillow", "safetensors"}
# pip's words when it could not reach an index (then the test is skipped, not failed).
UNREACHABLE = (
    "Could not find a version that satisfies",
    "No matching distribution found",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ProxyError",
)

USE_IT = """
import asyncio, json, sys
from pathlib import Path

import numpy as np

import app  # the caller's own package, not the service
from vae_client import AsyncClient, Client

url, out = sys.argv[1], Path(sys.argv[2])
z = np.random.default_rng(0).standard_normal((1, 16, 4, 4)).astype(np.float32)
with Client(url, timeout=60) as client:
    png = client.decode(z, model="flux-tiny")
    client.decode_to_file(z, out, model="flux-tiny")  # streamed to disk


async def twice() -> list[bytes]:
    async with AsyncClient(url, timeout=60) as ac:
        return await asyncio.gather(*(ac.decode(z, model="flux-tiny") for _ in range(2)))


pngs = asyncio.run(twice())
try:
    import torch  # noqa: F401
    has_torch = True
except ImportError:
    has_torch = False
print(json.dumps({
    "app": app.WHOSE, "png": png.hex(), "same_async": pngs == [png, png],
    "same_file": out.read_bytes() == png, "has_torch": has_torch,
}))
"""


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A new venv with only the client installed (from a copy: pip builds in the source tree)."""
    root = tmp_path_factory.mktemp("fresh")
    source = root / "client"
    shutil.copytree(CLIENT_SOURCE, source, ignore=shutil.ignore_patterns("tests", "*.egg-info",
                    "build", "__pycache__", ".*"))  # fmt: skip
    # without a pip of its own (bootstrapping one is most of a venv's making): this venv's
    # pip installs into it (`--python`), as a user's pip installs into their sampler's env
    venv = [sys.executable, "-m", "venv", "--without-pip", root / "venv"]
    subprocess.run(venv, check=True, timeout=300)
    python = root / "venv" / "bin" / "python"
    started = time.monotonic()
    pip = subprocess.run(
        [*_pip(python), "install", "--quiet", source],
        capture_output=True, text=True, timeout=900, env=_clean_env(),
    )  # fmt: skip
    if pip.returncode != 0:
        tail = " | ".join(pip.stderr.strip().splitlines()[-3:])
        if any(words in pip.stderr for words in UNREACHABLE):
            pytest.skip(f"pip cannot reach a package index to install the client: {tail}")
        pytest.fail(f"pip install ./clients/python failed: {pip.stderr}")
    print(f"fresh venv: client installed in {time.monotonic() - started:.1f} s")
    return python


def _pip(python: Path) -> list[str]:
    """pip (this venv's) acting on the environment of ``python``."""
    return [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check"]


def _clean_env() -> dict[str, str]:
    """This environment without anything that would let the fresh venv see this repository."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_install_brings_no_torch(fresh_venv):
    listed = subprocess.run(
        [*_pip(fresh_venv), "list", "--format=json"],
        capture_output=True, text=True, check=True, timeout=120, env=_clean_env(),
    )  # fmt: skip
    installed = {d["name"].lower(): d["version"] for d in json.loads(listed.stdout)}
    print("fresh venv:", ", ".join(f"{n} {v}" for n, v in sorted(installed.items())))
    assert "vae-render-client" in installed and {"httpx", "numpy"} <= set(installed)
    assert not SERVICE_ONLY & set(installed), installed
    assert "vae-render-service" not in installed


def test_the_installed_client_decodes_beside_a_callers_own_app(fresh_venv, flux_server, tmp_path):
    caller = tmp_path / "sampler"
    (caller / "app").mkdir(parents=True)
    (caller / "app" / "__init__.py").write_text("WHOSE = 'the sampler'\n")
    result = subprocess.run(
        [fresh_venv, "-c", USE_IT, flux_server, tmp_path / "out.png"],
        cwd=caller, capture_output=True, text=True, timeout=300, env=_clean_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["app"] == "the sampler" and not seen["has_torch"]
    assert seen["same_async"] and seen["same_file"]
    z = np.random.default_rng(0).standard_normal((1, 16, 4, 4)).astype(np.float32)
    with Client(flux_server, timeout=60) as here:  # the service's venv, the same service
        assert bytes.fromhex(seen["png"]) == here.decode(z, model="flux-tiny")
