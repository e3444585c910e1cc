"""``python -m app ...`` (or ``python -c ...``) as a process forked from an interpreter that
has already imported torch and the service.

Most of a fresh ``python -m app`` is importing torch (seconds of CPU), and the suite starts
dozens: servers held and killed, imports killed at each write step. ``popen`` and ``run``
start them from a server process that imported torch and ``app`` once (multiprocessing's
forkserver: a clean single-threaded process; each child is forked from it, not from the test
process and its threads). Each child is a real process: its own pid, its signals, its exit
status, its files, its working folder and environment, running the same ``__main__`` as the
command. Only the imports are done already.

Anything else (another interpreter, another checkout on PYTHONPATH, another working folder, a
``preexec_fn``) starts as a fresh ``subprocess.Popen``; so do the tests of the command line
as a user types it (tests/test_cli_*.py, the image build script, the client's install) and
a test that measures the process's memory (``fork=False``: a forked child shares pages with
the server it was forked from).
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

from app.families import PACKAGES  # the package names only: no torch

ROOT = Path(__file__).resolve().parents[1]
# what the server imports once (nothing that reads this test run's state: tests.faulty makes
# its gate folder at import, so each child imports it)
PRELOAD = ["torch", "safetensors.torch", "app.cli", "app.http", "app.store", "requests"]
PRELOAD += [f"app.families.{package}" for package in PACKAGES]

_context: Any = None


def _server() -> Any:
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__, *PRELOAD])
        _context = context
    return _context


def _forkable(cmd: list[str], cwd: Path | str | None, env: dict[str, str] | None) -> bool:
    same_path = env is None or env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")
    here = cwd is None or Path(cwd).resolve() == ROOT
    return (
        len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] in ("-m", "-c") and same_path and here
    )


def _child(cmd: list[str], env: dict[str, str], out: str | None, err: str | None) -> None:
    """In the forked process: the command's working folder, environment, output files and
    ``sys.argv``, then its ``__main__`` (``SystemExit`` is its exit status)."""
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(env)
    for path, fd in ((out, 1), (err, 2)):
        if path is not None:
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(target, fd)
            os.close(target)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, str(ROOT))  # what `python -m` / `-c` put first: the working folder
    flag, what, *args = cmd[1:]
    try:
        if flag == "-m":
            sys.argv = [what, *args]
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})
    finally:
        # what the interpreter does at its exit (multiprocessing's child would `os._exit` at
        # once): wait for the threads that are not daemons, then run the exit functions
        # (logging's flush among them); a server that would hang there hangs here too
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()


class Launched:
    """The part of ``subprocess.Popen`` the tests use, for a forked child. Piped output is a
    file, read once the child has ended (``communicate``, or ``stdout``/``stderr`` after
    ``wait``)."""

    def __init__(self, cmd: list[str], env: dict[str, str], stdout: Any, stderr: Any, text: bool):
        self.args, self.text, self.returncode = cmd, text, None
        self._piped: dict[str, Path] = {}
        paths = [
            self._target(name, stream) for name, stream in (("stdout", stdout), ("stderr", stderr))
        ]
        self._process = _server().Process(target=_child, args=(cmd, env, *paths), daemon=True)
        self._process.start()
        self.pid = self._process.pid

    def _target(self, name: str, stream: Any) -> str | None:
        if stream is None:
            return None
        if stream is subprocess.PIPE:
            handle, path = tempfile.mkstemp(prefix=f"launched-{name}-")
            os.close(handle)
            self._piped[name] = Path(path)
            return path
        if stream is subprocess.DEVNULL:
            return os.devnull
        stream.flush()
        return stream.name  # a file the test opened: the child appends to it

    def poll(self) -> int | None:
        self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, name: str) -> str | bytes | None:
        path = self._piped.get(name)
        if path is None:
            return None
        data = path.read_bytes()
        return data.decode() if self.text else data

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        self.wait(timeout)
        return self._read("stdout"), self._read("stderr")

    @property
    def stdout(self) -> IO | None:
        return self._open("stdout")

    @property
    def stderr(self) -> IO | None:
        return self._open("stderr")

    def _open(self, name: str) -> IO | None:
        """The output so far, as a stream (no file left open)."""
        data = self._read(name)
        if data is None:
            return None
        return io.StringIO(data) if isinstance(data, str) else io.BytesIO(data)

    def __del__(self) -> None:
        for path in self._piped.values():
            path.unlink(missing_ok=True)


Process = Launched | subprocess.Popen


def popen(
    cmd: list[str],
    cwd: Path | str | None = ROOT,
    env: dict[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    fork: bool = True,
) -> Process:
    """``subprocess.Popen(cmd, ...)``, forked from the preloaded server where it can be;
    ``fork=False``: a fresh interpreter (a test of the process's own memory)."""
    if fork and _forkable(cmd, cwd, env):
        return Launched(cmd, dict(os.environ if env is None else env), stdout, stderr, text)
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text)


def run(
    cmd: list[str], capture_output: bool = False, timeout: float | None = None, **options: Any
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, ...)``, forked from the preloaded server where it can be;
    ``options``: ``popen``'s."""
    pipe = subprocess.PIPE if capture_output else None
    proc = popen(cmd, stdout=pipe, stderr=pipe, **options)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
