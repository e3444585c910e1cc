"""Fault injection for tests: a decoder family that fails on demand, and a real server process.

The ``faulty`` family is known only inside ``registered()`` (``app.families.register``: app/families
is never edited); this module's ``FAMILY`` is its descriptor.

The decoder is a 1x1 conv to RGB and a nearest upsample, frame by frame for the video
variant (config ``video: true``, latent ``[B, 4, T, H, W]``, streamed one frame a chunk):
exact enough in bf16 to pass the parity gate, cheap enough for load tests. The first latent
cell of each batch row says what to do (the probe latent is N(0,1), so it never asks):

    z[b, 0, ...0] command, z[b, 1, ...0] its argument ``arg``, z[b, 2, ...0] a tag

    OOM_FAST     OutOfMemoryError on the fast path, tiled or not, at frame ``arg``
    OOM_UNTILED  OutOfMemoryError on the fast path unless decoding tiled, at frame ``arg``
    OOM_ALL      OutOfMemoryError on every path, at frame ``arg``
    CRASH        RuntimeError on every path, at frame ``arg``
    SLEEP        sleep ``arg`` seconds (per frame)
    HOLD         block until the test calls ``release(tag)``: a decode that takes exactly as
                 long as the test wants, on any machine (``started(tag)`` says it began)
    STICKY       the RuntimeError of a poisoned CUDA context (device-side assert), at ``arg``

``DECODED`` records (tag, path, frame) for every frame decoded; images are frame 0.
HOLD's gates are files in ``$FAULTY_GATE_DIR``, so a server process started by the tests
(``serve_process(..., faulty_family=True)``) is held and released the same way.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests
import torch
from torch import Tensor, nn

import app.families
from app.families.decoder import VAEDecoder
from app.families.descriptor import Family, Part
from app.store import write_model
from tests import launch, order
from tests.live import free_port

ROOT = Path(__file__).resolve().parents[1]

KEY = "faulty"
OOM_FAST, OOM_UNTILED, CRASH, SLEEP, OOM_ALL = 1001.0, 1002.0, 1003.0, 1004.0, 1005.0
HOLD = 1006.0
STICKY = 1007.0
HOLD_LIMIT_S = 120.0  # a test that never releases fails its decode instead of hanging
# one folder of HOLD gates per test session; servers started from it inherit the variable
GATE_DIR = Path(os.environ.get("FAULTY_GATE_DIR") or tempfile.mkdtemp(prefix="faulty-gates-"))
os.environ["FAULTY_GATE_DIR"] = str(GATE_DIR)
CONFIG = {"latent_channels": 4, "scale": 8}
DECODED: list[tuple[float, str, int]] = []  # (tag, "fast" | "tiled" | "cpu", frame)
BATCHES: list[int] = []  # batch size of every frame decode call, in order
_lock = threading.Lock()


def register() -> None:
    """Make ``faulty`` a known family for this process (app/families is not edited)."""
    app.families.register(KEY, __name__)


@contextmanager
def registered() -> Iterator[None]:
    """``faulty`` is a known family inside the block only (other tests see the real list)."""
    register()
    try:
        yield
    finally:
        app.families.unregister(KEY)


class Decoder(VAEDecoder):
    output_space = "signed"
    supports_tiling = True  # the runner's OOM retry decodes tiled before anything else

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.is_video = bool(config.get("video", False))  # shadows the class default
        self.proj = nn.Conv2d(int(config["latent_channels"]), 3, 1)
        self.up = nn.Upsample(scale_factor=self.spatial_scale, mode="nearest")

    @property
    def latent_channels(self) -> int:
        return int(self.config["latent_channels"])

    def working_bytes(self, latent_shape, element_size, tiled=False) -> int:
        # a 1x1 conv and an upsample: its output and little else, 16 values per output pixel
        return 16 * self.output_values(latent_shape) // 3 * element_size

    @property
    def spatial_scale(self) -> int:
        return int(self.config["scale"])

    def stages(self) -> list[tuple[str, nn.Module]]:
        return [("conv_in", self.proj), ("up_0", self.up)]

    def decode(self, z: Tensor, **options: Any) -> Tensor:
        if z.ndim == 5:
            return torch.cat(list(self.iter_decode(z, **options)), dim=2)
        return self._frame(z, 0, _commands(z), options)

    def iter_decode(self, z: Tensor, **options: Any) -> Iterator[Tensor]:
        if z.ndim == 4:
            yield self.decode(z, **options)
            return
        rows = _commands(z)
        for t in range(z.shape[2]):
            yield self._frame(z[:, :, t], t, rows, options).unsqueeze(2)

    def _frame(self, z: Tensor, t: int, rows: list[list[float]], options: dict) -> Tensor:
        fast = self.proj.weight.dtype != torch.float32
        path = "cpu" if not fast else "tiled" if options.get("tiled") else "fast"
        for command, arg, tag in rows:
            _act(command, arg, t, fast, path, tag)
        with _lock:
            DECODED.extend((tag, path, t) for _, _, tag in rows)
            BATCHES.append(len(rows))
        return self.up(self.proj(z.to(self.proj.weight.dtype))).clamp(-1, 1)


def _commands(z: Tensor) -> list[list[float]]:
    """(command, arg, tag) of every batch row: its first three channels' first cells."""
    return [[float(v) for v in row] for row in z.flatten(2)[:, :3, 0]]


def _act(command: float, arg: float, t: int, fast: bool, path: str, tag: float) -> None:
    if command == SLEEP:
        time.sleep(arg)
    if command == HOLD:
        _hold(tag)
    if command not in (OOM_FAST, OOM_UNTILED, OOM_ALL, CRASH, STICKY) or t != int(arg):
        return
    if command == STICKY:
        raise RuntimeError("CUDA error: device-side assert triggered")
    if command == OOM_ALL or (fast and command == OOM_FAST):
        raise torch.OutOfMemoryError(f"injected out of memory on the {path} path")
    if fast and command == OOM_UNTILED and path == "fast":
        raise torch.OutOfMemoryError("injected out of memory on the untiled path")
    if command == CRASH:
        raise RuntimeError("injected decoder fault")


def _gate(tag: float, what: str) -> Path:
    return GATE_DIR / f"{what}-{tag:g}"


def _hold(tag: float) -> None:
    _gate(tag, "started").touch()
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not _gate(tag, "release").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"HOLD {tag:g} was never released")
        time.sleep(0.005)


def release(*tags: float) -> None:
    """Let the HOLD decodes of ``tags`` finish (in this process or a server process)."""
    for tag in tags:
        _gate(tag, "release").touch()


def started(tag: float) -> bool:
    """Whether a worker has taken the HOLD decode of ``tag``."""
    return _gate(tag, "started").exists()


def wait_for(what: str, check: Callable[[], object], timeout: float = 60) -> None:
    """Poll ``check`` until it is true: wait for a state, never for a guessed duration."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not seen in {timeout} s: {what}")
        time.sleep(0.01)


def init_synthetic(decoder: Decoder, generator: torch.Generator) -> None:
    """Weights exact in bf16, so the fast path passes the gate."""
    with torch.no_grad():
        decoder.proj.weight.copy_(torch.tensor([0.5, -0.25, 0.125]).view(3, 1, 1, 1) / 4)
        decoder.proj.bias.zero_()


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The faulty family imports no checkpoint (``bake`` writes its models)."""
    raise ValueError(f"the {KEY} family imports no checkpoint ({source})")


FAMILY = Family(KEY, decoder=Part(Decoder, convert, init_synthetic))


def bake(store: Path, name: str = "faulty", **config: Any) -> None:
    """Write a faulty model into ``store`` (inside ``registered()``; the config may carry
    limits)."""
    decoder = Decoder({**CONFIG, **config})
    init_synthetic(decoder, torch.Generator())
    write_model(store, name, KEY, {**CONFIG, **config}, decoder.state_dict(), source="test")


def latent(
    command: float = 0.0, arg: float = 0.0, tag: float = 0.0, size: int = 4, frames: int = 0
) -> Tensor:
    """A [1, 4, size, size] latent (or [1, 4, frames, size, size]) carrying a command."""
    z = torch.zeros(1, CONFIG["latent_channels"], *((frames,) if frames else ()), size, size)
    z.view(1, CONFIG["latent_channels"], -1)[0, :3, 0] = torch.tensor([command, arg, tag])
    return z


def decoded(tag: float) -> list[tuple[str, int]]:
    """(path, frame) of every frame decoded for ``tag``, in order."""
    with _lock:
        return [(path, t) for got, path, t in DECODED if got == tag]


def decoded_tags() -> list[float]:
    with _lock:
        return [tag for tag, _, _ in DECODED]


# --- a real `python -m app serve` process (drain and load tests) ------------------------


@contextmanager
def serve_process(
    store: Path,
    log: Path,
    faulty_family: bool = False,
    root: Path = ROOT,
    fork: bool = True,
    loop_cpu_log: Path | None = None,
    **env: str,
) -> Iterator[tuple[str, launch.Process]]:
    """``python -m app serve`` on a loopback port, one torch thread; yields (url, process)
    once /readyz answers 200. Its output goes to ``log`` (a pipe could fill and block it).
    ``faulty_family``: the same CLI with the ``faulty`` family known (tests/faulty_serve.py);
    ``root``: the checkout whose ``app`` serves (a test's modified copy); ``fork``: False
    starts a fresh interpreter (tests/launch.py); ``loop_cpu_log``: the event loop's long
    callbacks are logged there (tests/loop_cpu.py)."""
    port = free_port()
    environ = {
        **os.environ,
        "VAE_DEVICE": "cpu",
        "VAE_DTYPE": "float32",
        "VAE_THREADS": "1",
        "VAE_LOG_FORMAT": "text",
        **env,
    }
    if environ.get("VAE_DTYPE", "auto") == "auto":
        order.note()  # the server reads the candidate order (tests/order.py)
    module = "tests.faulty_serve" if faulty_family else "app"
    if loop_cpu_log is not None:
        assert not faulty_family, "tests.loop_cpu serves the known families only"
        module, environ["LOOP_CPU_LOG"] = "tests.loop_cpu", str(loop_cpu_log)
    cmd = [sys.executable, "-m", module, "serve", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = launch.popen(
            [*cmd, "--models-dir", str(store)],
            cwd=root,
            env=environ,
            stdout=out,
            stderr=out,
            fork=fork,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, log)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _wait_ready(url: str, proc: launch.Process, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"server not ready in {timeout} s:\n{log.read_text()[-3000:]}")


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")
