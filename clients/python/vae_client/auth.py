"""Bearer tokens for the client: a fixed string, or a provider called for a fresh one.

A provider is any callable returning the token: a ``str`` (a JWT's ``exp`` claim, when it has
one, says when it expires), or a ``Token`` with an explicit expiry. ``TokenSource`` caches it,
calls the provider again ``margin`` seconds before it expires, and once more when the server
answers 401 (the token was revoked or rotated early). Thread-safe: concurrent calls share one
refresh. For Cloud Run IAM, ``vae_client.gcp.id_token_provider(url)`` fetches Google ID tokens.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Token:
    value: str
    expires_at: float | None = None  # Unix time; None: until the server refuses it


TokenProvider = Callable[[], "str | Token"]


def jwt_expiry(token: str) -> float | None:
    """The ``exp`` claim of a JWT (not verified: only to know when to refresh), else None."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        return float(payload["exp"])
    except (ValueError, KeyError, TypeError):
        return None


class TokenSource:
    """The current token of a provider, refreshed before expiry and after a 401."""

    def __init__(self, provider: TokenProvider, margin: float = 60.0) -> None:
        self.provider, self.margin = provider, margin
        self._token: Token | None = None
        self._lock = threading.Lock()

    def _fresh(self) -> Token | None:
        token = self._token
        if token is None:
            return None
        if token.expires_at is not None and time.time() >= token.expires_at - self.margin:
            return None
        return token

    def cached(self) -> str | None:
        """The cached token if it is still fresh (no provider call), else None."""
        token = self._fresh()
        return token.value if token else None

    def get(self) -> str:
        """A fresh token, calling the provider when the cached one is missing or expiring."""
        with self._lock:
            token = self._fresh()
            if token is None:
                token = self._token = _as_token(self.provider())
            return token.value

    def invalidate(self, refused: str) -> None:
        """The server refused ``refused``: forget it (unless another call already replaced it)."""
        with self._lock:
            if self._token is not None and self._token.value == refused:
                self._token = None


def _as_token(value: str | Token) -> Token:
    if isinstance(value, Token):
        return value
    if not isinstance(value, str) or not value:
        raise TypeError(f"a token provider must return a non-empty str or Token, not {value!r}")
    return Token(value, jwt_expiry(value))
