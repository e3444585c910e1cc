"""tests/launch.py: a forked command is a process as the command line's would be (its own
pid, exit status, signals, environment, working folder, output), only without the imports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests import launch

SHOW = """
import json, os, sys
import torch
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(),
                  "ppid": os.getppid(), "var": os.environ.get("LAUNCH_TEST"),
                  "path0": sys.path[0], "threads": torch.get_num_threads()}))
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def test_a_forked_command_has_its_own_process_state():
    env = {**os.environ, "LAUNCH_TEST": "set"}
    done = launch.run(
        [sys.executable, "-c", SHOW, "a", "b"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 3 and done.stderr == "to stderr\n", done.stderr
    seen = json.loads(done.stdout)
    assert seen["argv"] == ["-c", "a", "b"] and seen["var"] == "set"
    assert seen["cwd"] == str(launch.ROOT) == seen["path0"]
    assert seen["pid"] != os.getpid() and seen["ppid"] != os.getpid()  # the server's child
    assert "LAUNCH_TEST" not in os.environ  # the test process is untouched


def test_a_forked_module_runs_as_main_and_signals_reach_it(tmp_path):
    done = launch.run([sys.executable, "-m", "app", "nosuch"], capture_output=True, text=True)
    assert done.returncode == 2 and "invalid choice: 'nosuch'" in done.stderr
    log = tmp_path / "log"
    sleeper = "import time; print('up', flush=True); time.sleep(60)"
    with log.open("wb") as out:
        proc = launch.popen([sys.executable, "-c", sleeper], stdout=out)
    assert isinstance(proc, launch.Launched)
    deadline = time.monotonic() + 60
    while log.read_text() != "up\n":
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM


def test_what_cannot_be_forked_starts_fresh(tmp_path):
    other_folder = launch.popen([sys.executable, "-c", "pass"], cwd=tmp_path)
    other_path = launch.popen([sys.executable, "-c", "pass"], env={**os.environ, "PYTHONPATH": "x"})
    for proc in (other_folder, other_path):
        assert isinstance(proc, subprocess.Popen) and proc.wait(60) == 0


EXITS = """
import atexit, threading, time
atexit.register(print, "exit function", flush=True)
threading.Thread(target=lambda: (time.sleep(0.5), print("thread", flush=True))).start()
print("main", flush=True)
"""


def test_a_forked_command_exits_as_the_interpreter_does():
    """The threads that are not daemons end first, then the exit functions run: a command that
    would hang at its exit hangs here too."""
    done = launch.run([sys.executable, "-c", EXITS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["main", "thread", "exit function"], done.stdout
