"""A request's body, read within its limit (413 as soon as it is past it), its time (408;
503 at once when a shutdown begins) and the budget of what requests hold (app/http/budget.py:
429), and what the request holds once its body is parsed."""

from __future__ import annotations

import asyncio

from fastapi import Request
from starlette.requests import ClientDisconnect

from app.config import CLOUD_RUN_REQUEST_MB
from app.http.budget import BodyLease
from app.http.errors import ANOTHER_INSTANCE, ClientGone
from app.protocol import ProtocolError

# A declared body's room is claimed before it is read, and kept while the body keeps the pace
# that ends it within VAE_BODY_TIMEOUT_S; this long is free (a client's first bytes, a
# 100-continue). A body behind that pace (one that sends only its headers, or drips) loses
# what it has not sent: its room follows its bytes, and a client cannot hold the budget
# with requests it never sends.
CLAIM_GRACE_S = 2.0


async def read_body(request: Request, limit: int, timeout_s: float) -> bytearray:
    """The body, within the process's body budget (its declared length claimed before it is
    read, 429 when the budget cannot hold it now; held as it arrives), refused with 413 as
    soon as it exceeds the limit (not after reading it all), with 408 when it does not arrive
    within ``timeout_s`` (a slow-loris upload), and with 503 at once when a shutdown begins
    while it is still arriving."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        request.state.body_unread = True
        raise body_too_large(request, f"a body of {declared[:32]} bytes", limit)
    lease = request.state.body_lease = BodyLease(request.app.state.bodies)
    size = None if declared is None else int(declared)
    reading = asyncio.ensure_future(_receive(request, lease, limit, size, timeout_s))
    shutdown = asyncio.ensure_future(request.app.state.drain.began.wait())
    try:
        done, _ = await asyncio.wait(
            {reading, shutdown}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if reading in done:
            return reading.result()  # the body, or the refusal raised while it arrived
    except ProtocolError:
        request.state.body_unread = True
        raise
    finally:
        reading.cancel()
        shutdown.cancel()
    request.state.body_unread = True
    if shutdown in done:
        raise ProtocolError(503, "the service is shutting down", ANOTHER_INSTANCE)
    raise ProtocolError(
        408,
        f"the body did not arrive within {timeout_s:g} s",
        "the whole body within VAE_BODY_TIMEOUT_S",
    )


def body_too_large(request: Request, body: str, limit: int) -> ProtocolError:
    """The 413 of a body over the body limit: the limit, the setting and the platform's
    request limit behind it, and what the client sends instead."""
    why = f"VAE_MAX_BODY_MB={limit >> 20}"
    if request.app.state.settings.platform == "cloud-run":
        why += f", below Cloud Run's {CLOUD_RUN_REQUEST_MB} MiB limit on HTTP/1 requests"
    if request.url.path.startswith("/encode"):
        instead = ("send the image as PNG, JPEG or WebP, or the video as an MP4, instead of a "
                   "raw pixel tensor; or fewer batch rows per request")  # fmt: skip
    else:
        instead = ("send the latent as bfloat16 or float16 (half of float32's bytes); or "
                   "fewer batch rows or frames per request")  # fmt: skip
    return ProtocolError(
        413,
        f"{body} exceeds the limit of {limit} bytes ({why})",
        f"a body of at most {limit} bytes: {instead}",
    )


def hold(request: Request, size: int, grow: bool = True) -> None:
    """What the request holds now, in the same budget as its body: once parsed, its input
    (the latent, the pixels, an MP4's temporary file) and the most its answer can be (429
    when that does not fit now: a small body can parse into large pixels, or ask for a large
    answer); once answered, its answer until it is sent (``grow=False``: never more than it
    reserved)."""
    lease = getattr(request.state, "body_lease", None)
    if lease is not None:
        lease.hold(size if grow else min(size, lease.held))


async def _receive(
    request: Request, lease: BodyLease, limit: int, size: int | None, timeout_s: float
) -> bytearray:
    try:
        if size is None:
            return await _receive_chunked(request, lease, limit)
        lease.claim(size)
        return await _receive_declared(request, lease, size, timeout_s)
    except ClientDisconnect:
        raise ClientGone from None


async def _receive_declared(
    request: Request, lease: BodyLease, size: int, timeout_s: float
) -> bytearray:
    """A body of a declared length, into one buffer that grows as it arrives (no chunks, no
    join): memory follows the bytes sent, not the length declared (a buffer of that length,
    zero-filled at once, made a request that sent only its headers cost its whole length).
    A large buffer grows in place (glibc remaps it). Its claim on the budget lapses once it
    falls behind the pace that would end it within ``timeout_s`` (``CLAIM_GRACE_S`` free):
    one timer, moved on as the bytes come (not a task per chunk: docs/BENCHMARKS.md)."""
    body = bytearray()
    loop = asyncio.get_running_loop()
    started = loop.time()
    lapse = loop.call_at(started + CLAIM_GRACE_S, lease.lapse) if lease.claimed else None
    try:
        async for chunk in request.stream():
            if not chunk:  # the end, as Starlette's stream says it
                break
            if len(body) + len(chunk) > size:  # h11 frames by Content-Length: never more
                raise ProtocolError(
                    413,
                    f"body exceeds its Content-Length of {size} bytes",
                    "a body of its declared Content-Length",
                )
            lease.arrived(len(chunk))
            body += chunk
            if lapse is not None and lease.claimed:  # on pace so far: the next chunk's time
                lapse.cancel()
                pace = started + CLAIM_GRACE_S + len(body) * timeout_s / size
                lapse = loop.call_at(pace, lease.lapse)
    finally:
        if lapse is not None:
            lapse.cancel()
    if len(body) < size:  # a stream that ends early is a disconnect (Starlette raises it first)
        raise ClientGone
    return body


async def _receive_chunked(request: Request, lease: BodyLease, limit: int) -> bytearray:
    """A chunked body: its budget share grows with it."""
    body = bytearray()
    async for chunk in request.stream():
        size = len(body) + len(chunk)
        if size > limit:
            raise body_too_large(request, f"a chunked body of {size} bytes so far", limit)
        lease.cover(size)
        body += chunk
    return body
