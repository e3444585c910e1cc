"""A real uvicorn server on loopback, and small model stores, for HTTP tests."""

from __future__ import annotations

import socket
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
from app.decoders import family_module
from app.service import create_app
from app.store import write_model

TINY_FLUX = {
    "flux-tiny": {
        "latent_channels": 16,
        "block_out_channels": [16, 32, 32, 32],
        "layers_per_block": 1,
        "norm_num_groups": 8,
    },
    "sd-tiny": {
        "latent_channels": 4,
        "block_out_channels": [16, 32, 32, 32],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "use_post_quant_conv": True,
        "scaling_factor": 0.18215,
        "shift_factor": None,
    },
    "flux2-tiny": {
        "latent_channels": 32,
        "block_out_channels": [16, 32, 32, 32],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "use_post_quant_conv": True,
        "latent_bn": True,
    },
}


def bake(store: Path, family: str, name: str, config: dict[str, Any], seed: int = 0) -> None:
    """Write one seeded model into a store, as `python -m app bake` would."""
    module = family_module(family)
    decoder = module.Decoder(config)
    module.init_synthetic(decoder, torch.Generator().manual_seed(seed))
    write_model(store, name, family, config, decoder.state_dict(), source="test", dtype="float32")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(store: Path, **settings: Any) -> Iterator[str]:
    """Serve ``store`` with uvicorn on a loopback port; yields the base URL once ready."""
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
                if not app.state.runtime.loading:
                    break
        except requests.ConnectionError:
            pass
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(15)
