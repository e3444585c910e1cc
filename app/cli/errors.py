"""The command line's failure contract, for every command but ``serve``: one ``error:`` line
on stderr and exit status 1 (``VAE_DEBUG=1``: the traceback), 130 on Ctrl-C."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

from app.config import setting

Command = Callable[[argparse.Namespace], int]
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # torch colours some of its messages
MAX_LINE = 600


class CommandError(Exception):
    """A failure the command line reports in its own words (no traceback)."""


def one_line(command: Command) -> Command:
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            return 130
        except Exception as exc:  # noqa: BLE001 - the contract is one clear line, not a traceback
            if setting("debug"):
                raise
            print(f"error: {describe(exc)}", file=sys.stderr)
            return 1

    return run


def describe(exc: Exception) -> str:
    """The failure's own words where it names the problem (refusals, bad input, files); else
    its kind too, and how to see where it came from. Always one line."""
    if isinstance(exc, KeyError) and exc.args:
        return _one_line(str(exc.args[0]))  # str() would quote it
    store = sys.modules.get("app.store.files")  # loaded wherever a StoreError was raised;
    refusals = (store.StoreError,) if store else ()  # not imported here: it brings torch
    if isinstance(exc, (CommandError, ValueError, OSError, *refusals)):
        return _one_line(str(exc)) or type(exc).__name__
    words = _one_line(str(exc)) or "no message"
    return f"{type(exc).__name__}: {words} (VAE_DEBUG=1 shows the traceback)"


def _one_line(text: str) -> str:
    """A message of several lines (torch's, pydantic's) as one, without colour codes."""
    text = " ".join(ANSI.sub("", text).split())
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 3] + "..."
