"""What a failed call raises: the server's own words (``error``, ``expected``) and status."""

from __future__ import annotations

import json
from typing import Any


class DecodeError(Exception):
    """A decode that did not succeed: HTTP status (None: no response) and the server's words."""

    def __init__(
        self,
        status: int | None,
        error: str,
        expected: str | None = None,
        request_id: str | None = None,
        body: Any = None,
    ) -> None:
        self.status, self.error, self.expected = status, error, expected
        self.request_id, self.body = request_id, body
        where = f"HTTP {status}: " if status is not None else ""
        hint = f" (expected: {expected})" if expected else ""
        super().__init__(f"{where}{error}{hint}")


class DeadlineExceeded(DecodeError, TimeoutError):
    """The call's overall deadline passed (while waiting, retrying or receiving)."""


def error_from_response(status: int, content: bytes, request_id: str) -> DecodeError:
    """An error response -> DecodeError: the JSON ``{"error", "expected"}`` body when there is
    one, else the start of whatever the body says (a proxy's HTML page, say)."""
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        expected = body.get("expected")
        return DecodeError(
            status,
            str(body["error"]),
            None if expected is None else str(expected),
            request_id,
            body,
        )
    text = content[:300].decode("utf-8", "replace").strip() or "no body"
    return DecodeError(status, text, None, request_id, body)
