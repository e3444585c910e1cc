"""What the sync and async clients share: options, per-caller call records, and how a
response turns into a retry wait, an error, or a finished call."""

from __future__ import annotations

import asyncio
import contextvars
import os
import time

import httpx

from vae_client.auth import TokenProvider, TokenSource
from vae_client.errors import DecodeError, error_from_response
from vae_client.retry import RETRY_STATUS, Attempts, RetryPolicy, parse_retry_after
from vae_client.timing import CallInfo, parse_server_timing
from vae_client.wire import Request

DEFAULT_URL = os.environ.get("VAE_URL", "http://127.0.0.1:8080")


class BaseClient:
    """``timeout``: seconds per wait (connect, each read); ``deadline``: seconds for a whole
    call, retries included (None: no overall limit); ``max_retries``: retries of 429/503 and
    of connection failures; ``token``: sent as ``Authorization: Bearer`` (or $VAE_TOKEN): a
    string, or a provider (a callable returning one, see ``vae_client.auth``) called again
    ``token_refresh_margin`` seconds before the token expires and once per request on a 401."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        timeout: float = 300.0,
        token: str | TokenProvider | None = None,
        max_retries: int = 5,
        deadline: float | None = None,
        backoff: float = 0.25,
        max_backoff: float = 30.0,
        jitter: float = 0.5,
        connect_timeout: float = 10.0,
        token_refresh_margin: float = 60.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self._tokens = TokenSource(token, token_refresh_margin) if callable(token) else None
        self.token = None if callable(token) else token or os.environ.get("VAE_TOKEN") or None
        self.deadline = deadline
        self.retry = RetryPolicy(max_retries, backoff, max_backoff, jitter)
        # per thread / per task, so concurrent callers each read their own call's timings
        self._last: contextvars.ContextVar[CallInfo | None] = contextvars.ContextVar(
            f"last_{id(self)}", default=None
        )

    @property
    def last_call(self) -> CallInfo | None:
        return self._last.get()

    @property
    def last_timings(self) -> dict[str, float]:
        """Server-Timing phases of this thread's (or task's) last call, in milliseconds."""
        info = self._last.get()
        return dict(info.timings) if info else {}

    def _auth(self, token: str | None = None) -> dict[str, str]:
        token = token or self._current_token()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _current_token(self) -> str | None:
        """The token to send now (the provider is called when its token is due)."""
        return self._tokens.get() if self._tokens else self.token

    async def _current_token_async(self) -> str | None:
        """``_current_token`` without blocking the event loop on a provider's network call."""
        if self._tokens is None:
            return self.token
        return self._tokens.cached() or await asyncio.to_thread(self._tokens.get)

    def _retry_unauthorized(self, status: int, sent: str | None, retried: bool) -> bool:
        """A 401 to a provider's token: forget it and retry the request once with a new one."""
        if status != 401 or self._tokens is None or retried or sent is None:
            return False
        self._tokens.invalidate(sent)
        return True

    def _begin(self, deadline: float | None) -> Attempts:
        self._last.set(None)  # a failed call leaves no stale timings behind
        return Attempts(
            self.retry,
            self.timeout,
            self.connect_timeout,
            deadline if deadline is not None else self.deadline,
        )

    def _finish(self, attempts: Attempts, req: Request, response: httpx.Response) -> None:
        self._last.set(
            CallInfo(
                timings=parse_server_timing(response.headers.get("server-timing")),
                request_id=response.headers.get("x-request-id", req.headers["X-Request-Id"]),
                attempts=attempts.count,
                status=response.status_code,
                seconds=time.monotonic() - attempts.start,
                headers=dict(response.headers),
                waits=list(attempts.waits),
            )
        )

    def _refused(
        self, attempts: Attempts, response: httpx.Response, content: bytes, req: Request
    ) -> float:
        """An error response: the wait before retrying a 429/503, else raise its DecodeError."""
        error = error_from_response(response.status_code, content, req.headers["X-Request-Id"])
        if response.status_code not in RETRY_STATUS:
            raise error
        return attempts.delay(parse_retry_after(response.headers.get("retry-after")), error)

    def _check_answer(self, req: Request, response: httpx.Response) -> None:
        """A success must carry what was asked for (the request's Accept): another server at
        this URL (a proxy's page, a static file server) answers 200 too, and its HTML would be
        written as the image."""
        asked = req.headers.get("Accept", "")
        got = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if asked and got != asked:
            raise DecodeError(
                response.status_code,
                f"the answer is {got or 'untyped'}, not {asked}: is {self.base_url} the VAE "
                "render service?",
                request_id=response.headers.get("x-request-id", req.headers.get("X-Request-Id")),
            )

    def _unreachable(self, exc: Exception) -> DecodeError:
        return DecodeError(None, f"cannot reach {self.base_url}: {exc or type(exc).__name__}")
