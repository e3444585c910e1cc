"""A deadline for a request's headers, which uvicorn does not have.

uvicorn's ``timeout_keep_alive`` closes a connection that sends nothing between requests, but
any byte cancels it and nothing re-arms it until a response is complete: a client that sends
its headers a byte at a time holds a connection (and a file descriptor) for ever. The
protocol below gives every request ``seconds`` from the connection's start (or from the end
of the previous response) to finish its headers, else answers 408 and closes. The body has
its own deadline in the service (``VAE_BODY_TIMEOUT_S``).
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_BODY = json.dumps(
    {"error": "the request's headers did not arrive in time", "expected": "send them at once"}
).encode()
TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a ``seconds`` deadline on each request's headers; pass it
    as ``uvicorn.run(..., http=...)``."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request on this connection gets its own deadline

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # its headers are in
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.trailing_data[0]:  # part of a request came: say why it is closed
                self.transport.write(TIMEOUT_RESPONSE)
            self.transport.close()

    return HeaderTimeoutProtocol
