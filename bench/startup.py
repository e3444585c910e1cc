"""Cold start: seconds from ``python -m app serve`` to the first 200 of ``/readyz``.

    python -m bench startup [--models-dir models] [--runs 3] [--bake] [--env VAE_X=1 ...]

Each run starts a fresh ``python -m app serve`` over the store (baked already, unless
``--bake``: then ``python -m app bake --synthetic`` into an empty folder first, timed too), polls
``/readyz`` every 50 ms and stops the server once it answers 200; it prints the seconds to ready
and each model's state times and load phases from ``/models``, and, with ``--settle``, also waits
until every model's mode is measured (``VAE_SELECT=after_ready``). The machine line and the
load average go with the numbers: a shared machine reads slower.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import common

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models-dir", type=Path, default=ROOT / "models")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--bake", action="store_true", help="bake a fresh store first (timed)")
    parser.add_argument("--settle", action="store_true", help="also wait for every mode")
    parser.add_argument("--env", nargs="*", default=[], help="VAE_X=value for the server")


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except OSError:
        return 0, {}


def start(store: Path, env: dict[str, str], settle: bool) -> dict:
    """One start: seconds to /readyz 200 (and to every mode measured, with ``settle``)."""
    port = free_port()
    command = [sys.executable, "-m", "app", "serve", "--models-dir", str(store)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    t0 = time.perf_counter()
    server = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while _get(f"http://127.0.0.1:{port}/readyz")[0] != 200:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode}")
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        models = _get(f"http://127.0.0.1:{port}/models")[1]
        while settle and any(m.get("selection") not in (None, "done") for m in models["models"]):
            time.sleep(0.2)
            models = _get(f"http://127.0.0.1:{port}/models")[1]
        settled = time.perf_counter() - t0
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    return {"ready_s": ready, "settled_s": settled if settle else None, "models": models}


def run(args: argparse.Namespace) -> None:
    env = dict(e.split("=", 1) for e in args.env)
    print(common.machine(), f"load average {os.getloadavg()[0]:.1f}")
    store = args.models_dir
    if args.bake:
        store = Path(tempfile.mkdtemp(prefix="bench-startup-")) / "models"
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "app", "bake", "--synthetic", "--models-dir", str(store)],
            cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        print(f"bake: {time.perf_counter() - t0:.1f} s into {store}")
    for i in range(args.runs):
        result = start(store, env, args.settle)
        line = f"run {i + 1}: ready {result['ready_s']:.2f} s"
        if result["settled_s"] is not None:
            line += f", every mode measured {result['settled_s']:.1f} s"
        print(line, f"(load average {os.getloadavg()[0]:.1f})")
        for m in result["models"]["models"]:
            phases = ", ".join(f"{k} {v:.2f}" for k, v in m.get("phase_seconds", {}).items())
            print(f"  {m['name']}: {m['mode']} ({m['chosen_because']}); {phases}")
