"""``python -m app decode``: one latent file -> one output file, in this process from the
local store (app/cli/local_decode.py) or through a running service with ``--url`` (the sampler-side
client, ``vae_client``, which never imports torch). Progress on stderr, ``--timings``'
per-phase table on stdout, and any failure as one ``error:`` line and exit status 1.
A video's frames show in a progress bar on a terminal (decoded here, or as the service's
streamed answer arrives); ``--quiet`` shows nothing."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from app.cli.errors import CommandError
from app.cli.local_decode import (
    check_latent_file,
    check_model,
    decode_file,
    output_for,
)

SPINNER = "|/-\\"
PARAM_NAMES = (
    "do_scaling",
    "scaling_factor",
    "shift_factor",
    "height",
    "width",
    "fps",
    "quality",
    "timestep",
    "seed",
)


class Progress:
    """Progress on stderr while a decode runs: on a terminal, a line redrawn in place with a
    spinner and the elapsed time, and, once the decode reports frames (a video, decoded here
    or streamed from the service), a bar ``[#####.....] 48/121 frames``.

    Off a terminal no bar is drawn: only the frame updates are printed, at most one line a
    second, so logs stay short. ``enabled=False`` (``--quiet``) prints nothing.
    """

    WIDTH = 24  # the bar's cells

    def __init__(self, label: str, enabled: bool = True, stream: IO[str] | None = None) -> None:
        self.label, self.stream = label, stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and _is_tty(self.stream)
        self.detail, self.start, self._last_line = "", time.monotonic(), 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the spinner's thread and update() both draw
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._tick = 0

    def __enter__(self) -> Progress:
        if self.tty:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.tty:
            self._thread.join()
            self.stream.write("\r\033[K")
            self.stream.flush()

    def update(self, done: int, total: int, unit: str = "frames") -> None:
        """``done`` of ``total`` (frames) so far: the bar on a terminal, a line a second off
        it. The decode's own callback, locally and through ``vae_client``'s ``progress``."""
        if total > 0:
            fill = min(self.WIDTH, self.WIDTH * done // total)
            bar = f"[{'#' * fill}{'.' * (self.WIDTH - fill)}] "
        else:
            bar = ""
        self.detail = f"{bar}{done}/{total} {unit}"
        now = time.monotonic()
        if self.tty:
            self._draw()
        elif self.enabled and (now - self._last_line >= 1 or done >= total):
            self._last_line = now
            print(
                f"{self.label}: {done}/{total} {unit} ({now - self.start:.1f} s)", file=self.stream
            )

    def _draw(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            elapsed = time.monotonic() - self.start
            spin = SPINNER[self._tick % 4]
            self.stream.write(f"\r{spin} {self.label} {elapsed:6.1f} s {self.detail}\033[K")
            self.stream.flush()

    def _spin(self) -> None:
        while not self._stop.wait(0.1):
            self._tick += 1
            self._draw()


def _is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def run(args: argparse.Namespace) -> int:
    latent, out, store = Path(args.latent), Path(args.output), Path(args.models_dir)
    check_latent_file(latent)
    output_for(out)  # a suffix neither path can write: refused before anything else
    if not args.url:
        check_model(store, args.model)  # before torch's import: fail fast
    params = {n: getattr(args, n, None) for n in PARAM_NAMES}
    params = {k: v for k, v in params.items() if v is not None and v is not False}
    where = args.url or f"store {store}"
    started = time.monotonic()
    with Progress(f"decoding {latent.name} with {args.model} ({where})", not args.quiet) as p:
        if args.url:
            timings = _decode_remote(args, latent, out, params, p.update)
        else:
            timings = decode_file(latent, args.model, out, store, params, on_frames=p.update)
    elapsed = time.monotonic() - started
    if not args.quiet:
        print(f"wrote {out} ({out.stat().st_size} bytes) in {elapsed:.2f} s", file=sys.stderr)
    if args.timings:
        print(format_timings(timings, elapsed * 1000))
    return 0


def _decode_remote(
    args: argparse.Namespace,
    latent: Path,
    out: Path,
    params: dict[str, Any],
    on_frames: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Through a running service: the latent file is the request body, as it is on disk; the
    client asks for what the output file's suffix names, and tells ``on_frames`` the frames
    of a video as its streamed answer arrives."""
    try:
        from vae_client import Client, DecodeError
    except ImportError:
        raise CommandError(
            "--url needs the client: pip install ./clients/python (vae-render-client)"
        ) from None
    logging.getLogger("httpx").setLevel(
        logging.WARNING
    )  # the CLI logs at INFO: no per-request lines
    try:
        with Client(args.url, timeout=args.timeout, deadline=args.timeout, max_retries=3) as c:
            c.decode_to_file(latent, out, args.model, progress=on_frames, **params)
            return c.last_timings
    except DecodeError as exc:
        raise CommandError(str(exc)) from exc


def format_timings(timings: dict[str, float], total_ms: float | None = None) -> str:
    """The per-phase table ``--timings`` prints (milliseconds and share of the total)."""
    total = timings.get("total", total_ms) or sum(timings.values()) or 1.0
    rows = [f"{'phase':<16}{'ms':>10}{'share':>8}"]
    for name, ms in timings.items():
        if name != "total":
            rows.append(f"{name:<16}{ms:>10.1f}{ms / total:>8.1%}")
    rows.append(f"{'total':<16}{total:>10.1f}")
    if total_ms is not None and "total" in timings:
        rows.append(f"{'client wall':<16}{total_ms:>10.1f}")
    return "\n".join(rows)
