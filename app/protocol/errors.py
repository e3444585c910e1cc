"""The refusal every protocol check raises: an HTTP status, what was wrong, what was expected."""

from __future__ import annotations

import re
from typing import Any

MAX_ECHO = 64  # characters of a client's value an error message repeats
_ADDRESS = re.compile(r"<([\w.]+) object at 0x[0-9a-fA-F]+>")


class ProtocolError(Exception):
    """A request the service refuses: HTTP status, what was wrong, what was expected."""

    def __init__(self, status: int, error: str, expected: str | None = None) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.expected = expected

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": self.error}
        if self.expected:
            out["expected"] = self.expected
        return out


def echo(value: object, limit: int = MAX_ECHO) -> str:
    """A client's value as an error message repeats it: repr'd, clipped to ``limit``."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def plain(exc: BaseException, limit: int = 200) -> str:
    """A parser's message for a client: object reprs without memory addresses, clipped."""
    text = _ADDRESS.sub(r"<\1>", str(exc))
    return text if len(text) <= limit else text[: limit - 3] + "..."
