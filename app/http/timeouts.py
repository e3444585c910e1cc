"""uvicorn's h11 protocol, hardened: a deadline on a request's headers, JSON for h11's own
400s, and a closing connection that still lets the client read its answer.

* Headers: uvicorn's ``timeout_keep_alive`` closes a connection that sends nothing between
  requests, but any byte cancels it and nothing re-arms it until a response is complete: a
  client that sends its headers a byte at a time holds a connection (and a file descriptor)
  for ever. Every request here gets ``seconds`` from the connection's start (or from the end
  of the previous response) to finish its headers, else 408 and the connection closes. The
  body has its own deadline in the service (``VAE_BODY_TIMEOUT_S``).
* A request h11 cannot parse is answered with the JSON every other error is.
* Closing (a ``Connection: close`` answer: the SIGTERM drain's 503, a 413 refused before its
  body, the 400 of a request framed twice) half-closes the connection and reads and discards
  what the client is still sending, up to ``LINGER_BYTES`` or ``LINGER_S``, then closes.
  Closing a socket with unread data in it sends a TCP reset, which can destroy the answer
  before a client still uploading reads it.
* Shutdown: a connection holding part of a request (its headers not all in) is answered 503
  (+ ``Retry-After``) before it closes, so every request that reached the server gets an
  answer; an idle keep-alive connection is closed at once, without the linger.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_BYTES = 64 << 20  # what a closing connection still reads (and discards) of a body
LINGER_S = 5.0  # how long it waits for the client to stop sending

_BODY = json.dumps(
    {"error": "the request's headers did not arrive in time", "expected": "send them at once"}
).encode()
TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)
MALFORMED_BODY = json.dumps(
    {"error": "malformed HTTP request", "expected": "an HTTP/1.1 request (RFC 9112)"}
).encode()
_SHUTDOWN_BODY = json.dumps(
    {"error": "the service is shutting down", "expected": "retry: another instance"}
).encode()


def shutdown_response(retry_after_s: int) -> bytes:
    """The 503 a connection holding part of a request gets when the server shuts down."""
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"retry-after: %d\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
        % (retry_after_s, len(_SHUTDOWN_BODY), _SHUTDOWN_BODY)
    )


class LingeringTransport:
    """The connection's transport as uvicorn sees it, except that ``close`` lingers: the
    answer is flushed and the write side shut (FIN), the client's rest is read and dropped,
    and the socket closes once the client closes its side or the linger runs out."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self.lingering = False
        self.discarded = 0
        self._timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def write(self, data: bytes) -> None:
        if not self.lingering:
            self._transport.write(data)

    def close(self) -> None:
        if self.lingering or self._transport.is_closing():
            return
        self.lingering = True
        try:
            self._transport.write_eof()
            self._transport.resume_reading()  # uvicorn may have paused it: drain the rest
        except (OSError, RuntimeError, NotImplementedError):
            self._transport.close()
            return
        self._timer = self._loop.call_later(LINGER_S, self.shut)

    def discard(self, data: bytes) -> None:
        """Data that arrived after the answer: dropped, up to the bound."""
        self.discarded += len(data)
        if self.discarded > LINGER_BYTES:
            self.shut()

    def shut(self) -> None:
        """Close for real."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport.close()


def header_timeout_protocol(seconds: float, retry_after_s: int = 1) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a ``seconds`` deadline on each request's headers, JSON
    400s, lingering closes and a 503 (``Retry-After: retry_after_s``) for a request caught
    half-received by the shutdown; pass it as ``uvicorn.run(..., http=...)``."""
    shutting_down = shutdown_response(retry_after_s)

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(LingeringTransport(transport, self.loop))  # type: ignore[arg-type]
            self._arm()

        def data_received(self, data: bytes) -> None:
            transport = self.transport
            if isinstance(transport, LingeringTransport) and transport.lingering:
                transport.discard(data)  # answered and closing: never a next request
                return
            super().data_received(data)

        def eof_received(self) -> bool | None:
            transport = self.transport
            if isinstance(transport, LingeringTransport) and transport.lingering:
                transport.shut()
            return super().eof_received()

        def send_400_response(self, msg: str) -> None:
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            response = h11.Response(status_code=400, headers=headers, reason=b"Bad Request")
            try:
                for event in (response, h11.Data(data=MALFORMED_BODY), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # a response had already started: just close
                pass
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request on this connection gets its own deadline

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # its headers are in
                self._disarm()

        def shutdown(self) -> None:
            transport = self.transport
            if not isinstance(transport, LingeringTransport):
                super().shutdown()
                return
            if transport.is_closing():
                return  # an answered refusal lingers: it ends on its own (client EOF, timer)
            if self.cycle is not None and not self.cycle.response_complete:
                super().shutdown()  # a request in the app: it answers, then the close
                return
            self._disarm()
            if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
                transport.write(shutting_down)  # headers half in: answered, then lingers
                transport.close()
            elif self.conn.their_state is h11.IDLE:
                transport.shut()  # idle keep-alive: nothing to answer, nothing to linger for
            else:
                super().shutdown()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            transport = self.transport
            if isinstance(transport, LingeringTransport) and transport._timer is not None:
                transport._timer.cancel()
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
