"""``python -m app decode``: in-process from the local store, and through a running service."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import save as save_safetensors

from app.cli import main
from tests.conftest import ROOT
from tests.live import bake, live_server

# Runs the CLI and reports on stderr, at exit, whether torch was ever imported.
WRAPPER = (
    "import atexit, sys; "
    "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules, file=sys.stderr)); "
    "from app.cli import main; main(['decode', *sys.argv[1:]])"
)
# The same, in an environment without the client package installed.
WITHOUT_CLIENT = "import sys; sys.modules['vae_client'] = None; " + WRAPPER


def cli(*args: str | Path, wrapper: str = WRAPPER) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", wrapper, *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)


def latent(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def video_server(tmp_path_factory) -> Iterator[str]:
    from app.families.minimax_h3 import decoder as minimax_h3

    store = tmp_path_factory.mktemp("video-store")
    bake(store, "minimax-h3", "video-tiny", minimax_h3.SYNTHETIC["minimax-h3-tiny"])
    with live_server(store, dtype="float32", default_model="video-tiny") as url:
        yield url


def run_main(*args: str | Path) -> int:
    """The same command in this process (torch is already loaded here: cheaper)."""
    with pytest.raises(SystemExit) as info:
        main(["decode", *map(str, args)])
    return info.value.code


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("latents")
    z = latent(1, 16, 4, 6, seed=3)
    np.save(folder / "z.npy", z)
    (folder / "z.safetensors").write_bytes(save_safetensors({"z": z}))
    np.save(folder / "four.npy", latent(1, 4, 4, 6))
    return {"npy": folder / "z.npy", "st": folder / "z.safetensors",
            "four": folder / "four.npy", "dir": folder}  # fmt: skip


def test_png_in_process_and_through_the_service_are_identical(files, flux_store, flux_server):
    out = files["dir"]
    local = cli(files["npy"], "--model", "flux-tiny", "-o", out / "local.png",
                "--models-dir", flux_store, "--timings")  # fmt: skip
    remote = cli(files["st"], "--model", "flux-tiny", "-o", out / "remote.png",
                 "--url", flux_server, "--timings")  # fmt: skip
    assert local.returncode == 0, local.stderr
    assert remote.returncode == 0, remote.stderr
    a, b = Image.open(out / "local.png"), Image.open(out / "remote.png")
    assert a.format == b.format == "PNG" and a.size == b.size == (48, 32)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the per-phase tables: the decoder's own stages locally, the Server-Timing ones remotely
    for phase in ("import", "load", "parse", "conv_in", "up_0", "encode", "total"):
        assert phase in local.stdout, local.stdout
    for phase in ("parse", "queue", "conv_in", "encode", "total", "client wall"):
        assert phase in remote.stdout, remote.stdout
    assert "wrote" in local.stderr and "Traceback" not in local.stderr + remote.stderr
    # the --url path is the sampler-side client: it never imports torch
    assert "torch imported: False" in remote.stderr
    assert "torch imported: True" in local.stderr


def test_safetensors_in_process_matches_npy_through_the_service(files, flux_store, flux_server):
    a, b = files["dir"] / "st-local.png", files["dir"] / "npy-remote.png"
    assert run_main(files["st"], "--model", "flux-tiny", "-o", a, "--models-dir", flux_store) == 0
    assert run_main(files["npy"], "--model", "flux-tiny", "-o", b, "--url", flux_server, "-q") == 0
    np.testing.assert_array_equal(np.asarray(Image.open(a)), np.asarray(Image.open(b)))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "latent file not found"),
        ("model", "'nope' is not in the store"),
        ("channels", "latent has 4 channels but this model takes 16"),
        ("suffix", "cannot tell the output format"),
        ("unreachable", "cannot reach"),
        ("no folder", "the folder"),  # checked before the decode, not at its end
        ("a folder", "is a folder"),
    ],
)
def test_errors_are_one_clear_line(case, message, files, flux_store, flux_server):
    out = files["dir"] / f"{case}.png"
    args: list[str | Path] = [files["npy"], "--model", "flux-tiny", "-o", out]
    where: list[str | Path] = ["--models-dir", flux_store]
    if case == "missing":
        args[0] = files["dir"] / "absent.npy"
    elif case == "model":
        args[2] = "nope"
    elif case == "channels":  # refused by the service: the 422's words, one line
        args[0], where = files["four"], ["--url", flux_server]
    elif case == "suffix":
        args[4] = files["dir"] / "out.gif"
    elif case == "unreachable":
        where = ["--url", "http://127.0.0.1:9", "--timeout", "1"]
    elif case == "no folder":
        args[4] = out = files["dir"] / "absent" / "out.png"
    elif case == "a folder":
        (files["dir"] / "taken.png").mkdir(exist_ok=True)
        args[4] = out = files["dir"] / "taken.png"
    result = cli(*args, *where)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("torch imported")]
    assert result.returncode == 1 and lines and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and message in lines[0], lines
    assert not out.exists() or out.is_dir()
    assert "torch imported: False" in result.stderr  # failing fast, before the heavy import


def test_url_without_the_client_installed_says_how_to_get_it(files, flux_server):
    out = files["dir"] / "no-client.png"
    result = cli(files["npy"], "--model", "flux-tiny", "-o", out, "--url", flux_server,
                 wrapper=WITHOUT_CLIENT)  # fmt: skip
    assert result.returncode == 1 and "pip install ./clients/python" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


def test_bad_latent_in_process(files, flux_store, capsys):
    code = run_main(files["four"], "--model", "flux-tiny", "-o", files["dir"] / "x.png",
                    "--models-dir", flux_store)  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.count("\n") == 0
    assert err == "error: latent has 4 channels but this model takes 16 (expected: [B,16,H,W])"


def test_video_in_process_and_through_the_service(video_server, tmp_path, capsys):
    from app.families.minimax_h3 import decoder as minimax_h3

    store = tmp_path / "store"
    bake(store, "minimax-h3", "video-tiny", minimax_h3.SYNTHETIC["minimax-h3-tiny"])
    np.save(tmp_path / "zv.npy", latent(1, 24, 2, 2, 2, seed=5))
    common = [tmp_path / "zv.npy", "--model", "video-tiny"]
    assert run_main(*common, "-o", tmp_path / "local.npy", "--models-dir", store) == 0
    assert "frames" in capsys.readouterr().err  # per-chunk progress (stderr is not a TTY)
    assert run_main(*common, "-o", tmp_path / "remote.npy", "--url", video_server, "-q") == 0
    local, remote = np.load(tmp_path / "local.npy"), np.load(tmp_path / "remote.npy")
    assert local.ndim == 5 and local.shape[:2] == (1, 3)
    np.testing.assert_array_equal(local, remote)
    frames = local.shape[2]

    import imageio_ffmpeg

    assert run_main(*common, "-o", tmp_path / "local.mp4", "--models-dir", store, "--fps", "8") == 0  # noqa: E501
    n, seconds = imageio_ffmpeg.count_frames_and_secs(str(tmp_path / "local.mp4"))
    assert n == frames and seconds == pytest.approx(frames / 8, abs=0.1)
    assert (
        run_main(*common, "-o", tmp_path / "remote.mp4", "--url", video_server, "--fps", "8") == 0
    )  # noqa: E501
    assert _mp4_frames(tmp_path / "local.mp4") == _mp4_frames(tmp_path / "remote.mp4")


def _mp4_frames(path: Path) -> list[bytes]:
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    next(reader)  # metadata
    return list(reader)


def test_the_local_mp4_encoder_runs_with_the_bounded_encoder_threads(tmp_path, monkeypatch):
    """VAE_ENCODER_THREADS bounds the local MP4's ffmpeg as it bounds the service's streams
    (the real ffmpeg runs; its command line is recorded on the way)."""
    import subprocess as real_subprocess

    from app.families.minimax_h3 import decoder as minimax_h3
    from app.media import mp4

    store = tmp_path / "store"
    bake(store, "minimax-h3", "video-tiny", minimax_h3.SYNTHETIC["minimax-h3-tiny"])
    np.save(tmp_path / "zv.npy", latent(1, 24, 2, 2, 2, seed=5))
    commands: list[list[str]] = []
    popen = real_subprocess.Popen  # the module's own: patched below for every caller

    def recorded(args: list[str], *rest, **kwargs) -> real_subprocess.Popen:
        commands.append(list(args))
        return popen(args, *rest, **kwargs)

    monkeypatch.setattr(mp4.subprocess, "Popen", recorded)
    monkeypatch.setenv("VAE_ENCODER_THREADS", "3")
    out = tmp_path / "local.mp4"
    args = [tmp_path / "zv.npy", "--model", "video-tiny", "-o", out, "--models-dir", store]
    assert run_main(*args) == 0
    assert out.stat().st_size > 0
    (ffmpeg,) = [c for c in commands if "libx264" in c]
    assert ffmpeg[ffmpeg.index("-threads") + 1] == "3"


def on_terminal(*args: str | Path) -> tuple[str, int]:
    """The command with its stderr on a pseudo-terminal: (what it wrote there, exit status)."""
    import os
    import pty

    master, slave = pty.openpty()
    cmd = [sys.executable, "-c", WRAPPER, *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    out = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        out += data
    os.close(master)
    return out.decode(errors="replace"), proc.wait(180)


BAR = "[" + "#" * 24 + "]"  # a full bar: every frame in


def test_a_video_shows_a_progress_bar_on_a_terminal_only(video_server, tmp_path):
    """Through the service (the client's progress callback) and in process alike: a bar on
    a terminal, none with --quiet, and off a terminal only a frame line a second."""
    from app.families.minimax_h3 import decoder as minimax_h3

    store = tmp_path / "store"
    bake(store, "minimax-h3", "video-tiny", minimax_h3.SYNTHETIC["minimax-h3-tiny"])
    np.save(tmp_path / "zv.npy", latent(1, 24, 2, 2, 2, seed=5))
    common = [tmp_path / "zv.npy", "--model", "video-tiny"]
    for i, where in enumerate((["--url", video_server], ["--models-dir", store])):
        drawn, code = on_terminal(*common, "-o", tmp_path / f"bar{i}.npy", *where)
        frames = np.load(tmp_path / f"bar{i}.npy").shape[2]
        assert code == 0 and f"{BAR} {frames}/{frames} frames" in drawn, drawn
        assert re.search("\r(?!\n)", drawn) and "wrote" in drawn  # redrawn in place
        quiet, code = on_terminal(*common, "-o", tmp_path / f"quiet{i}.npy", *where, "-q")
        said = [line for line in quiet.splitlines() if not line.startswith("torch imported")]
        assert code == 0 and not any(said), quiet
        piped = cli(*common, "-o", tmp_path / f"pipe{i}.npy", *where)
        assert piped.returncode == 0, piped.stderr
        assert "\r" not in piped.stderr and "#" not in piped.stderr  # no bar into a pipe
        assert f"{frames}/{frames} frames" in piped.stderr  # the log's line
