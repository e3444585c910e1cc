"""A real uvicorn server on loopback, small model stores (baked, or imported with the real
CLI), and raw requests to it, for HTTP tests."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests
import torch
import uvicorn

from app.config import Settings
from app.families import family
from app.http import create_app
from app.store import write_model
from tests import launch

# the project root, where `python -m app` runs (not from tests.conftest: live.py is also
# imported outside pytest, by the faulty server's subprocesses)
ROOT = Path(__file__).resolve().parents[1]

# ``band_mb``: row bands of 1 MiB (the entry's own, app/families/flux/decoder/decode.py): a band
# of the default 32 MiB at these widths is a 724-pixel square, and the gate's tiled probe (two
# bands) would cost ten times the plain one; at 1 MiB it is the plain probe's 256 pixels in
# four bands
TINY_FLUX = {
    "flux-tiny": {
        "latent_channels": 16,
        "block_out_channels": [16, 32, 32, 32],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "band_mb": 1,
    },
    "sd-tiny": {
        "latent_channels": 4,
        "block_out_channels": [16, 32, 32, 32],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "use_post_quant_conv": True,
        "scaling_factor": 0.18215,
        "shift_factor": None,
        "band_mb": 1,
    },
    "flux2-tiny": {
        "latent_channels": 32,
        "block_out_channels": [16, 32, 32, 32],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "use_post_quant_conv": True,
        "latent_bn": True,
        "band_mb": 1,
    },
}


def bake(
    store: Path,
    family_key: str,
    name: str,
    config: dict[str, Any],
    seed: int = 0,
    encoder: bool = False,
) -> None:
    """Write one seeded model into a store, as `python -m app bake` would (``encoder``: with
    the family's encoder, seeded ``seed + 1``)."""
    described = family(family_key)
    decoder = described.decoder.module(config)
    described.decoder.init_synthetic(decoder, torch.Generator().manual_seed(seed))
    encoder_state = None
    if encoder:
        module = described.encoder.module(config)
        described.encoder.init_synthetic(module, torch.Generator().manual_seed(seed + 1))
        encoder_state = module.state_dict()
    write_model(
        store,
        name,
        family_key,
        config,
        decoder.state_dict(),
        source="test",
        dtype="float32",
        encoder_state=encoder_state,
        encoder_config=config if encoder else None,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(store: Path, selected: bool = True, **settings: Any) -> Iterator[str]:
    """Serve ``store`` with uvicorn on a loopback port; yields the base URL once ready and,
    unless ``selected`` is False, every part's mode chosen (``VAE_DTYPE=auto`` on a CPU
    measures the modes after ready, in the background: a test would otherwise meet the exact
    path or the chosen copy by timing, and read the candidate order during its own run,
    tests/order.py)."""
    app = create_app(Settings(models_dir=store, **settings))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/readyz", timeout=1).status_code in (200, 503):
                if not app.state.runtime.loading and (not selected or _selected(app.state.runtime)):
                    break
        except (requests.ConnectionError, requests.Timeout):  # not up yet, or busy loading
            pass
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(15)


def _selected(runtime: Any) -> bool:
    """No part's mode is still to be measured (``registry.select_pending``)."""
    parts = [*runtime.models.values(), *runtime.encoders.values()]
    return all(p.state is None or p.state.selection not in ("pending", "measuring") for p in parts)


def cli_import(store: Path, *models: tuple[str, Path, str], references: bool = True) -> list[str]:
    """Import each ``(family, source, name)`` into ``store`` with the real CLI, as a user
    would; all at once, since most of each run is importing torch. Returns their stdouts.
    ``references=False``: ``--no-references`` (a store served float32 exact gates nothing)."""
    runs = []
    for key, source, name in models:
        command = [sys.executable, "-m", "app", "import", key, str(source)]
        command += ["--name", name, "--models-dir", str(store)]
        command += [] if references else ["--no-references"]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        runs.append(launch.popen(command, cwd=ROOT, text=True, **pipes))
    outputs = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        outputs.append(out)
    return outputs


def import_pretrained(
    store: Path, family: str, vaes: dict[str, Any], references: bool = False
) -> None:
    """Each diffusers VAE ``save_pretrained`` as the ``vae/`` of a pipeline folder beside
    ``store``, then imported into ``store`` under its name with the real CLI (without the
    gate references unless asked: the tests serve these float32 exact, which gates nothing)."""
    for name, vae in vaes.items():
        vae.save_pretrained(store.parent / name / "vae")
    cli_import(
        store, *((family, store.parent / name, name) for name in vaes), references=references
    )


def post(
    url: str, model: str, z: torch.Tensor, accept: str | None = None, **params: Any
) -> requests.Response:
    """POST ``z`` as raw float32 ``tensor/binary`` to ``/decode/{model}``, with query
    ``params`` remote_decode cannot send (timestep, seed, fps); asserts a 200."""
    query = {"shape": json.dumps(list(z.shape)), "dtype": "float32"}
    query.update({k: str(v) for k, v in params.items()})
    headers = {"Content-Type": "tensor/binary"}
    if accept:
        headers["Accept"] = accept
    r = requests.post(
        f"{url}/decode/{model}",
        params=query,
        data=z.numpy().tobytes(),
        headers=headers,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r


def tensor_of(r: requests.Response) -> torch.Tensor:
    """The float32 tensor of a ``pt`` answer, shaped as its ``shape`` header says."""
    assert r.headers["dtype"] == "float32"
    data = torch.frombuffer(bytearray(r.content), dtype=torch.float32)
    return data.reshape(json.loads(r.headers["shape"]))


def timed_phases(r: requests.Response) -> set[str]:
    """The phase names of an answer's ``Server-Timing`` header."""
    return {p.split(";")[0].strip() for p in r.headers["Server-Timing"].split(",")}
