"""Optional bearer-token auth (``VAE_API_TOKENS``), as pure ASGI middleware.

It answers before the route runs, so an unauthenticated request never has its body read.
Tokens are compared in constant time (``hmac.compare_digest`` over SHA-256 digests, so the
length of a configured token does not leak either), against every configured token.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from app.http.docs import DOCS_PATHS

# the probes; the page and the API's description (static: every call they make needs the token)
OPEN_PATHS = frozenset(
    {"/healthz", "/readyz", "/", "/page/page.js", "/page/page.css", "/page/icon.svg"}
    | {"/openapi.json"}
    | DOCS_PATHS
)
REALM = "vae"


class BearerAuth:
    """Requires ``Authorization: Bearer <token>`` on every route but the open ones, and tells
    those whether one came (``request.state.authorized``)."""

    def __init__(self, app: ASGIApp, tokens: list[str], protect_metrics: bool = False) -> None:
        self.app = app
        self._digests = [_digest(t.encode()) for t in tokens]
        self._open = OPEN_PATHS if protect_metrics else OPEN_PATHS | {"/metrics"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._digests:
            return await self.app(scope, receive, send)
        presented = _bearer(scope)
        authorized = presented is not None and self._matches(presented)
        if scope["path"] in self._open:  # an open route may say more to a caller with a token
            scope.setdefault("state", {})["authorized"] = authorized
            return await self.app(scope, receive, send)
        if authorized:
            return await self.app(scope, receive, send)
        await _refusal(presented)(scope, receive, send)

    def _matches(self, token: bytes) -> bool:
        digest, matched = _digest(token), False
        for known in self._digests:  # no early exit: the time does not say which one matched
            matched |= hmac.compare_digest(digest, known)
        return matched


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _bearer(scope: Scope) -> bytes | None:
    """The token of the (first) ``Authorization: Bearer`` header, or None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def _refusal(presented: bytes | None) -> JSONResponse:
    """401 per RFC 6750: no error code when no token came, ``invalid_token`` otherwise."""
    if presented is None:
        challenge, error = f'Bearer realm="{REALM}"', "missing bearer token"
    else:
        challenge = f'Bearer realm="{REALM}", error="invalid_token"'
        error = "invalid bearer token"
    return JSONResponse(
        {"error": error, "expected": "Authorization: Bearer <token>"},
        status_code=401,
        headers={"WWW-Authenticate": challenge},
    )
