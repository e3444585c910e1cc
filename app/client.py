"""A client for the sampler, and ``python -m app decode`` (local store or a running service).

The client side needs no torch: latents go in as numpy arrays (float32/float16), raw
little-endian bytes with ``shape``/``dtype``, a ``.npy``/``.safetensors`` path, or a torch
tensor when the caller already has torch loaded (bfloat16 included). Images come back as
encoded bytes (or PIL), tensors as numpy, MP4 as bytes or streamed to a file::

    client = Client("http://127.0.0.1:8080")
    png = client.decode(latent, model="flux1", do_scaling=True)

429/503 are retried after ``Retry-After`` (jittered, at most ``max_retries`` times, never
past ``deadline``); a refused request raises ``DecodeError`` with the server's ``error`` and
``expected``. Only the command line's in-process mode imports torch (lazily).
"""

from __future__ import annotations

import asyncio
import contextvars
import email.utils
import io
import json
import logging
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import numpy as np

DEFAULT_URL = os.environ.get("VAE_URL", "http://127.0.0.1:8080")
RETRY_STATUS = frozenset({429, 503})
# output -> (query params, Accept): the same params remote_decode sends for each
OUTPUTS: dict[str, tuple[dict[str, str], str]] = {
    "png": ({"output_type": "pil", "image_format": "png"}, "image/png"),
    "jpeg": ({"output_type": "pil", "image_format": "jpg"}, "image/jpeg"),
    "webp": ({"output_type": "pil", "image_format": "webp"}, "image/webp"),
    "mp4": ({"output_type": "mp4"}, "video/mp4"),
    "tensor": ({"output_type": "pt"}, "tensor/binary"),  # decoder output space, or uint8
    "frames": ({"output_type": "pil"}, "tensor/binary"),  # [N,3,H,W] in [0,1]
}
ALIASES = {"jpg": "jpeg", "pt": "tensor", "npy": "tensor"}
SUFFIX_OUTPUT = {
    ".png": "png",
    ".jpg": "jpeg",
    ".jpeg": "jpeg",
    ".webp": "webp",
    ".mp4": "mp4",
    ".npy": "tensor",
}
FILE_TYPES = {".npy": "application/x-npy", ".safetensors": "application/x-safetensors"}
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "uint8": np.uint8}


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


@dataclass
class CallInfo:
    """What the last call saw: Server-Timing phases (ms), request id, attempts, status."""

    timings: dict[str, float] = field(default_factory=dict)
    request_id: str = ""
    attempts: int = 0
    status: int = 0
    seconds: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


# --- request and response helpers (shared by Client and AsyncClient) -----------------


@dataclass
class _Request:
    path: str
    params: list[tuple[str, str]]
    headers: dict[str, str]
    body: bytes
    output: str


def _output_name(output: str) -> str:
    name = ALIASES.get(output.lower(), output.lower())
    if name not in OUTPUTS:
        raise ValueError(f"output {output!r} is not one of {', '.join(OUTPUTS)}")
    return name


def _encode_latent(latent: Any, params: dict[str, Any]) -> tuple[bytes, str, dict[str, Any]]:
    """Latent -> (body, Content-Type, wire params). Raw bytes need ``shape`` (and ``dtype``)."""
    if isinstance(latent, bytes | bytearray | memoryview):
        if "shape" not in params:
            raise ValueError("a raw bytes latent needs shape=[...] (and dtype=, default float32)")
        return bytes(latent), "tensor/binary", {}
    if isinstance(latent, os.PathLike):
        path = Path(latent)
        if path.suffix.lower() not in FILE_TYPES:
            raise ValueError(f"{path}: a latent file is .npy or .safetensors")
        return path.read_bytes(), FILE_TYPES[path.suffix.lower()], {}
    if type(latent).__module__.split(".")[0] == "torch":
        return _encode_torch(latent)
    array = np.asarray(latent)
    if array.dtype == np.float64:
        array = array.astype(np.float32)  # the wire has no float64
    if array.dtype not in (np.float32, np.float16):
        raise ValueError(f"latent dtype {array.dtype} is not float32 or float16")
    array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return array.tobytes(), "tensor/binary", {"shape": list(array.shape), "dtype": array.dtype.name}


def _encode_torch(tensor: Any) -> tuple[bytes, str, dict[str, Any]]:
    import torch  # the caller has it loaded already: this costs nothing

    t = tensor.detach().to("cpu").contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype == "bfloat16":  # numpy has no bfloat16: ship the raw 16-bit words
        data = t.view(torch.int16).numpy().astype("<i2").tobytes()
    elif dtype in ("float32", "float16"):
        data = t.numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()
    else:
        t, dtype = t.float(), "float32"
        data = t.numpy().astype("<f4").tobytes()
    return data, "tensor/binary", {"shape": list(t.shape), "dtype": dtype}


def _query(params: dict[str, Any]) -> list[tuple[str, str]]:
    """remote_decode's conventions: lists as repeated keys, booleans as true/false."""
    items: list[tuple[str, str]] = []
    for key, value in params.items():
        if value is None:
            continue
        values = value if isinstance(value, list | tuple) else [value]
        for v in values:
            items.append((key, ("true" if v else "false") if isinstance(v, bool) else str(v)))
    return items


def _build(
    latent: Any, model: str | None, output: str, params: dict[str, Any], token: str | None
) -> _Request:
    name = _output_name(output)
    body, content_type, wire = _encode_latent(latent, params)
    fixed, accept = OUTPUTS[name]
    query = _query({**fixed, **wire, **params})
    headers = {"Content-Type": content_type, "Accept": accept, "X-Request-Id": uuid.uuid4().hex}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    path = f"/decode/{model}" if model else "/decode"
    return _Request(path, query, headers, body, name)


def parse_server_timing(header: str | None) -> dict[str, float]:
    """``a;dur=1.2, b;desc="x";dur=3`` -> ``{"a": 1.2, "b": 3.0}`` (milliseconds)."""
    out: dict[str, float] = {}
    for entry in (header or "").split(","):
        name, *attrs = [p.strip() for p in entry.split(";")]
        if not name:
            continue
        for attr in attrs:
            key, _, value = attr.partition("=")
            if key.strip().lower() == "dur":
                try:
                    out[name] = out.get(name, 0.0) + float(value.strip('"'))
                except ValueError:
                    pass
    return out


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from ``Retry-After`` (delta-seconds or an HTTP date); None if absent or bad."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _error_from(status: int, content: bytes, request_id: str) -> DecodeError:
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


def _to_array(content: bytes | bytearray, headers: httpx.Headers) -> np.ndarray:
    """A tensor response (``shape`` and ``dtype`` headers) -> numpy (bfloat16 -> float32)."""
    shape = json.loads(headers.get("shape", "null"))
    dtype = headers.get("dtype", "float32")
    if dtype == "bfloat16":
        words = np.frombuffer(content, dtype="<u2").astype(np.uint32) << 16
        return words.view(np.float32).reshape(shape)
    if dtype not in NP_DTYPES:
        raise DecodeError(None, f"unexpected tensor dtype {dtype!r} in the response")
    return np.frombuffer(content, dtype=np.dtype(NP_DTYPES[dtype]).newbyteorder("<")).reshape(shape)


def _result(output: str, content: bytearray, headers: httpx.Headers) -> bytes | np.ndarray:
    """Encoded media as bytes; tensors as numpy over the received buffer (writable, no copy)."""
    return _to_array(content, headers) if output in ("tensor", "frames") else bytes(content)


class _Attempts:
    """Retry bookkeeping for one call: per-attempt timeout, jittered delays, the deadline."""

    def __init__(self, client: _Base, deadline: float | None) -> None:
        self.client = client
        self.start = time.monotonic()
        self.end = None if deadline is None else self.start + deadline
        self.count = 0
        self.last_status: int | None = None

    def remaining(self) -> float | None:
        return None if self.end is None else self.end - time.monotonic()

    def timeout(self) -> httpx.Timeout:
        left = self.remaining()
        if left is not None and left <= 0:
            raise self.expired("before the request was sent")
        t = self.client.timeout if left is None else min(self.client.timeout, left)
        return httpx.Timeout(t, connect=min(t, self.client.connect_timeout))

    def check(self) -> None:
        left = self.remaining()
        if left is not None and left <= 0:
            raise self.expired("while receiving the response")

    def expired(self, when: str) -> DeadlineExceeded:
        spent = time.monotonic() - self.start
        return DeadlineExceeded(
            self.last_status,
            f"deadline exceeded {when} after {spent:.2f} s and {self.count} attempt(s)",
        )

    def delay(self, retry_after: float | None, error: DecodeError) -> float:
        """Seconds to wait before the next attempt, or raise ``error`` / the deadline."""
        if self.count > self.client.max_retries:
            raise error
        if retry_after is not None and retry_after > self.client.max_backoff:
            raise error  # longer than this client waits: say so now rather than sleep on it
        base = min(self.client.max_backoff, self.client.backoff * 2 ** (self.count - 1))
        wait = retry_after if retry_after is not None else base
        wait = (
            wait * (1 + random.random() * self.client.jitter)
            + random.random() * self.client.backoff
        )
        left = self.remaining()
        if left is not None and wait >= left:
            raise self.expired(f"before the next attempt, due in {wait:.1f} s ({error})")
        return wait


class _Base:
    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        timeout: float = 300.0,
        token: str | None = None,
        max_retries: int = 5,
        deadline: float | None = None,
        backoff: float = 0.25,
        max_backoff: float = 30.0,
        jitter: float = 0.5,
        connect_timeout: float = 10.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.token = token or os.environ.get("VAE_TOKEN") or None
        self.max_retries, self.deadline = max_retries, deadline
        self.backoff, self.max_backoff, self.jitter = backoff, max_backoff, jitter
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

    def _finish(self, attempts: _Attempts, req: _Request, response: httpx.Response) -> None:
        self._last.set(
            CallInfo(
                timings=parse_server_timing(response.headers.get("server-timing")),
                request_id=response.headers.get("x-request-id", req.headers["X-Request-Id"]),
                attempts=attempts.count,
                status=response.status_code,
                seconds=time.monotonic() - attempts.start,
                headers=dict(response.headers),
            )
        )

    def _refused(
        self, attempts: _Attempts, response: httpx.Response, content: bytes, req: _Request
    ) -> float:
        """An error response: the wait before retrying a 429/503, else raise its DecodeError."""
        error = _error_from(response.status_code, content, req.headers["X-Request-Id"])
        if response.status_code not in RETRY_STATUS:
            raise error
        return attempts.delay(parse_retry_after(response.headers.get("retry-after")), error)

    def _unreachable(self, exc: Exception) -> DecodeError:
        return DecodeError(None, f"cannot reach {self.base_url}: {exc or type(exc).__name__}")


# --- the synchronous client --------------------------------------------------------


class Client(_Base):
    """Decode latents against a running service (thread-safe; reuse one per process).

    ``timeout``: seconds per attempt (connect/read); ``deadline``: seconds for a whole call,
    retries included (None: no overall limit); ``max_retries``: retries of 429/503 and of
    connection failures; ``token``: sent as ``Authorization: Bearer`` (or $VAE_TOKEN).
    """

    def __init__(self, base_url: str = DEFAULT_URL, **options: Any) -> None:
        super().__init__(base_url, **options)
        self._http = httpx.Client(base_url=self.base_url, timeout=self.timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def decode(
        self,
        latent: Any,
        model: str | None = None,
        output: str = "png",
        *,
        deadline: float | None = None,
        **params: Any,
    ) -> bytes | np.ndarray:
        """One latent -> encoded image/MP4 bytes, or numpy for ``tensor``/``frames``.

        ``params`` are the service's query params (``do_scaling``, ``scaling_factor``,
        ``shift_factor``, ``height``, ``width``, ``fps``, ``quality``, ``timestep``, ...).
        """
        req = _build(latent, model, output, params, self.token)
        buf = bytearray()
        response = self._send(req, buf.extend, deadline)
        return _result(req.output, buf, response.headers)

    def decode_image(self, latent: Any, model: str | None = None, **params: Any) -> Any:
        """One latent -> a ``PIL.Image`` (PNG on the wire: lossless)."""
        from PIL import Image

        return Image.open(io.BytesIO(self.decode(latent, model, "png", **params)))

    def decode_to_file(
        self,
        latent: Any,
        path: str | os.PathLike,
        model: str | None = None,
        output: str | None = None,
        *,
        deadline: float | None = None,
        **params: Any,
    ) -> Path:
        """Decode and write ``path`` (format from its suffix), streaming the body to disk."""
        path = Path(path)
        output = output or _suffix_output(path)
        if _output_name(output) in ("tensor", "frames"):
            array = self.decode(latent, model, output, deadline=deadline, **params)
            with _atomic(path) as f:
                np.save(f, array)
            return path
        req = _build(latent, model, output, params, self.token)
        with _atomic(path) as f:
            self._send(req, f.write, deadline)
        return path

    def models(self) -> dict[str, Any]:
        return self._http.get("/models", headers=self._auth()).raise_for_status().json()

    def ready(self) -> bool:
        try:
            return self._http.get("/readyz", headers=self._auth(), timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _send(
        self, req: _Request, sink: Callable[[bytes], Any], deadline: float | None
    ) -> httpx.Response:
        attempts = _Attempts(self, deadline if deadline is not None else self.deadline)
        self._last.set(None)  # a failed call leaves no stale timings behind
        while True:
            attempts.count += 1
            try:
                with self._http.stream(
                    "POST",
                    req.path,
                    params=req.params,
                    headers=req.headers,
                    content=req.body,
                    timeout=attempts.timeout(),
                ) as response:
                    attempts.last_status = response.status_code
                    if response.status_code >= 400:
                        wait = self._refused(attempts, response, response.read(), req)
                    else:
                        for chunk in response.iter_bytes():
                            attempts.check()
                            sink(chunk)
                        self._finish(attempts, req, response)
                        return response
            except httpx.TimeoutException as exc:
                raise _timed_out(attempts, exc) from None
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                wait = attempts.delay(None, self._unreachable(exc))
            time.sleep(wait)


# --- the asyncio client --------------------------------------------------------------


class AsyncClient(_Base):
    """``Client`` for asyncio callers: same arguments, ``await client.decode(...)``."""

    def __init__(self, base_url: str = DEFAULT_URL, **options: Any) -> None:
        super().__init__(base_url, **options)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def decode(
        self,
        latent: Any,
        model: str | None = None,
        output: str = "png",
        *,
        deadline: float | None = None,
        **params: Any,
    ) -> bytes | np.ndarray:
        req = _build(latent, model, output, params, self.token)
        buf = bytearray()
        response = await self._send(req, buf.extend, deadline)
        return _result(req.output, buf, response.headers)

    async def decode_to_file(
        self,
        latent: Any,
        path: str | os.PathLike,
        model: str | None = None,
        output: str | None = None,
        *,
        deadline: float | None = None,
        **params: Any,
    ) -> Path:
        path = Path(path)
        output = output or _suffix_output(path)
        if _output_name(output) in ("tensor", "frames"):
            array = await self.decode(latent, model, output, deadline=deadline, **params)
            with _atomic(path) as f:
                np.save(f, array)
            return path
        req = _build(latent, model, output, params, self.token)
        with _atomic(path) as f:
            await self._send(req, f.write, deadline)
        return path

    async def _send(
        self, req: _Request, sink: Callable[[bytes], Any], deadline: float | None
    ) -> httpx.Response:
        attempts = _Attempts(self, deadline if deadline is not None else self.deadline)
        self._last.set(None)  # a failed call leaves no stale timings behind
        while True:
            attempts.count += 1
            try:
                async with self._http.stream(
                    "POST",
                    req.path,
                    params=req.params,
                    headers=req.headers,
                    content=req.body,
                    timeout=attempts.timeout(),
                ) as response:
                    attempts.last_status = response.status_code
                    if response.status_code >= 400:
                        wait = self._refused(attempts, response, await response.aread(), req)
                    else:
                        async for chunk in response.aiter_bytes():
                            attempts.check()
                            sink(chunk)
                        self._finish(attempts, req, response)
                        return response
            except httpx.TimeoutException as exc:
                raise _timed_out(attempts, exc) from None
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                wait = attempts.delay(None, self._unreachable(exc))
            await asyncio.sleep(wait)


def _timed_out(attempts: _Attempts, exc: Exception) -> DecodeError:
    left = attempts.remaining()
    if left is not None and left <= 0.05:
        return attempts.expired("waiting for the server")
    return DecodeError(
        None,
        f"timed out waiting for the server ({type(exc).__name__}, "
        f"timeout {attempts.client.timeout} s)",
    )


def _suffix_output(path: Path) -> str:
    try:
        return SUFFIX_OUTPUT[path.suffix.lower()]
    except KeyError:
        raise ValueError(
            f"{path}: cannot tell the output format from the suffix "
            f"(use {', '.join(SUFFIX_OUTPUT)})"
        ) from None


@contextmanager
def _atomic(path: Path) -> Iterator[IO[bytes]]:
    """Write beside ``path`` and rename on success: no half-written output files."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
    try:
        with tmp.open("wb") as f:
            yield f
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def decode(
    latent: Any,
    url: str = DEFAULT_URL,
    model: str | None = None,
    output: str = "png",
    **params: Any,
) -> bytes | np.ndarray:
    """One-shot ``Client(url).decode(...)``; keep a ``Client`` for repeated calls."""
    client_options = {
        k: params.pop(k) for k in ("timeout", "token", "max_retries", "deadline") if k in params
    }
    with Client(url, **client_options) as client:
        return client.decode(latent, model, output, **params)


# --- python -m app decode ------------------------------------------------------------

SPINNER = "|/-\\"


class CliError(Exception):
    """A failure the command line reports as one line (no traceback)."""


class Progress:
    """An elapsed-time spinner on stderr (a TTY), plus per-chunk updates for video decodes.

    Off a TTY it prints only chunk updates, at most one a second, so logs stay short.
    """

    def __init__(self, label: str, enabled: bool = True, stream: IO[str] | None = None) -> None:
        self.label, self.stream = label, stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.detail, self.start, self._last_line = "", time.monotonic(), 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def __enter__(self) -> Progress:
        if self.tty:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.tty:
            self._thread.join()
            self.stream.write("\r\033[K")
            self.stream.flush()

    def update(self, done: int, total: int, unit: str = "frames") -> None:
        self.detail = f"{done}/{total} {unit}"
        now = time.monotonic()
        if self.enabled and not self.tty and (now - self._last_line >= 1 or done >= total):
            self._last_line = now
            print(f"{self.label}: {self.detail} ({now - self.start:.1f} s)", file=self.stream)

    def _spin(self) -> None:
        i = 0
        while not self._stop.wait(0.1):
            elapsed = time.monotonic() - self.start
            line = f"\r{SPINNER[i % 4]} {self.label} {elapsed:6.1f} s {self.detail}\033[K"
            self.stream.write(line)
            self.stream.flush()
            i += 1


def decode_file(args: Any) -> int:
    """``python -m app decode``: 0, or one ``error:`` line on stderr and a non-zero exit."""
    try:
        return _decode_file(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the contract is one clear line, not a traceback
        if os.environ.get("VAE_DEBUG"):
            raise
        print(f"error: {_describe(exc)}", file=sys.stderr)
        return 1


def _describe(exc: Exception) -> str:
    expected = getattr(exc, "expected", None)
    if type(exc).__name__ == "ProtocolError" and expected:
        return f"{exc} (expected: {expected})"
    if isinstance(exc, CliError | DecodeError | ValueError | OSError) or type(exc).__name__ in (
        "StoreError",
        "ProtocolError",
    ):
        return str(exc)
    return f"{type(exc).__name__}: {exc} (VAE_DEBUG=1 shows the traceback)"


def _decode_file(args: Any) -> int:
    latent, out = Path(args.latent), Path(args.output)
    if not latent.is_file():
        raise CliError(f"latent file not found: {latent}")
    if latent.suffix.lower() not in FILE_TYPES:
        raise CliError(f"{latent}: a latent file is .npy or .safetensors")
    output = _suffix_output(out)
    params = _cli_params(args)
    where = args.url or f"store {args.models_dir}"
    started = time.monotonic()
    with Progress(
        f"decoding {latent.name} with {args.model} ({where})", enabled=not args.quiet
    ) as progress:
        if args.url:
            timings = _decode_remote(args, latent, out, output, params)
        else:
            timings = _decode_local(args, latent, out, output, params, progress)
    elapsed = time.monotonic() - started
    if not args.quiet:
        print(f"wrote {out} ({out.stat().st_size} bytes) in {elapsed:.2f} s", file=sys.stderr)
    if args.timings:
        print(format_timings(timings, elapsed * 1000))
    return 0


def _cli_params(args: Any) -> dict[str, Any]:
    names = (
        "do_scaling",
        "scaling_factor",
        "shift_factor",
        "height",
        "width",
        "fps",
        "quality",
        "timestep",
        "seed",
    )
    params = {n: getattr(args, n, None) for n in names}
    if not params["do_scaling"]:
        params["do_scaling"] = None
    return {k: v for k, v in params.items() if v is not None}


def format_timings(timings: dict[str, float], total_ms: float | None = None) -> str:
    """The per-phase table ``--timings`` prints (milliseconds and share of the total)."""
    total = timings.get("total", total_ms) or sum(timings.values()) or 1.0
    rows = [f"{'phase':<16}{'ms':>10}{'share':>8}"]
    for name, ms in timings.items():
        if name != "total":
            rows.append(f"{name:<16}{ms:>10.1f}{ms / total:>8.1%}")
    rows.append(f"{'total':<16}{total:>10.1f}")
    if total_ms is not None and "total" in timings:
        rows.append(f"{'client wall':<16}{total_ms:>10.1f}")
    return "\n".join(rows)


def _decode_remote(
    args: Any, latent: Path, out: Path, output: str, params: dict[str, Any]
) -> dict[str, float]:
    """Through a running service: the latent file is the request body, as it is on disk."""
    logging.getLogger("httpx").setLevel(
        logging.WARNING
    )  # the CLI logs at INFO: no per-request lines
    with Client(args.url, timeout=args.timeout, deadline=args.timeout, max_retries=3) as client:
        client.decode_to_file(latent, out, args.model, output, **params)
        return client.last_timings


def _decode_local(
    args: Any, latent_path: Path, out: Path, output: str, params: dict[str, Any], progress: Progress
) -> dict[str, float]:
    """In this process, from the local store, on the exact float32 CPU path the service
    falls back to (same parsing, layout rules and encoders as the service)."""
    if not (Path(args.models_dir) / args.model / "manifest.json").is_file():
        raise CliError(_not_in_store(Path(args.models_dir), args.model))
    t0 = time.perf_counter()
    import torch

    from app.timing import PhaseTimer

    timer = PhaseTimer()
    timer.add("import", time.perf_counter() - t0)  # torch's import is most of a small decode
    decoder = _load_decoder(Path(args.models_dir), args.model, timer)
    with timer.phase("parse"):
        z, wire_dtype = _read_latent(latent_path, params, decoder)
    with torch.inference_mode():
        chunks = _iter_decoded(decoder, z, params, timer, progress)
        if output == "mp4":
            _write_mp4(decoder, z, chunks, out, params, timer)
        else:
            decoded = _cat(list(chunks))
            with timer.phase("encode"):
                _write_output(decoder, decoded, out, output, params, wire_dtype)
    return {name: seconds * 1000 for name, seconds in timer.phases().items()}


def _load_decoder(store: Path, name: str, timer: Any) -> Any:
    import torch

    from app import timing
    from app.store import list_models, load_model

    with timer.phase("load"):
        names = list_models(store)
        if name not in names:
            raise CliError(_not_in_store(store, name))
        _, decoder = load_model(store, name)
        if any(p.dtype != torch.float32 for p in decoder.parameters()):
            decoder = decoder.float()  # the exact path: float32, as the service's reference
    timing.instrument(decoder.stages())
    return decoder


def _not_in_store(store: Path, name: str) -> str:
    """Names the store's entries without importing torch (the manifests are plain files)."""
    have = sorted(p.parent.name for p in store.glob("*/manifest.json")) if store.is_dir() else []
    return (
        f"model {name!r} is not in the store {store} (it has: {', '.join(have) or 'nothing'}); "
        "see --models-dir, `python -m app bake` and `import`"
    )


def _read_latent(path: Path, params: dict[str, Any], decoder: Any) -> tuple[Any, Any]:
    """The file -> a float32 [B,C,H,W] / [B,C,T,H,W] latent, checked as the service checks."""
    from app.protocol import DecodeParams, ModelGeometry, parse_body, to_layout

    wire = DecodeParams(height=params.get("height"), width=params.get("width"))
    tensor = parse_body(FILE_TYPES[path.suffix.lower()], path.read_bytes(), wire)
    geo = ModelGeometry(
        decoder.latent_channels,
        decoder.spatial_scale,
        decoder.temporal_scale,
        decoder.is_video,
        decoder.frames_out,
    )
    return to_layout(tensor, wire, geo).float(), tensor.dtype


def _iter_decoded(
    decoder: Any, z: Any, params: dict[str, Any], timer: Any, progress: Progress
) -> Iterator[Any]:
    """De-normalize and decode; a video decoder with ``iter_decode`` yields (and reports)
    each frame chunk as it is decoded, anything else one tensor."""
    from app.engine import Scaling

    scaling = Scaling(
        params.get("scaling_factor"), params.get("shift_factor"), bool(params.get("do_scaling"))
    )
    options = {k: params[k] for k in ("timestep", "seed") if k in params}
    with timer.phase("denormalize"):
        z = scaling.apply(decoder, z)
    if not (decoder.is_video and hasattr(decoder, "iter_decode")):
        with timer.active():
            out = decoder.decode(z, **options)
        yield out
        return
    total = decoder.frames_out(z.shape[2]) if z.ndim == 5 else 1
    done = 0
    with timer.active():
        for chunk in decoder.iter_decode(z, **options):
            done += chunk.shape[2]
            progress.update(done, total)
            yield chunk


def _cat(chunks: list[Any]) -> Any:
    import torch

    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)


def _write_output(
    decoder: Any, decoded: Any, out: Path, output: str, params: dict[str, Any], wire_dtype: Any
) -> None:
    """An image (one, as the service's image responses) or the raw decode as ``.npy``."""
    import torch

    from app import media

    if output == "tensor":
        dtype = wire_dtype if wire_dtype != torch.bfloat16 else torch.float32
        with _atomic(out) as f:
            np.save(f, decoded.to(dtype).numpy())
        return
    unit = decoder.to_unit(decoded)
    frames = unit.permute(0, 2, 1, 3, 4).flatten(0, 1) if unit.ndim == 5 else unit
    if frames.shape[0] != 1:
        raise CliError(
            f"this latent decodes to {frames.shape[0]} images; {out.suffix} holds one "
            "(use a batch-1 latent, or .mp4 / .npy)"
        )
    fmt = {"jpeg": "jpg"}.get(output, output)
    data = media.encode_image(frames[0], fmt, int(params.get("quality", 90)))
    with _atomic(out) as f:
        f.write(data)


def _write_mp4(
    decoder: Any, z: Any, chunks: Iterator[Any], out: Path, params: dict[str, Any], timer: Any
) -> None:
    """Frames streamed into the encoder chunk by chunk as they are decoded, as the service
    streams them; ``encode`` is the encoder's own time, not the decode it waits on."""
    if not decoder.is_video:
        raise CliError("mp4 output needs a video model (this one decodes images)")
    if z.shape[0] != 1:
        raise CliError(f"an mp4 holds one video; this latent is a batch of {z.shape[0]}")
    try:
        from app.video import encode_mp4, iter_frames
    except ImportError as exc:
        raise CliError(f"mp4 output is not available in this build ({exc})") from None
    fps = params.get("fps") or decoder.config.get("fps") or 24
    waited = 0.0

    def frames() -> Iterator[Any]:
        nonlocal waited
        units = (decoder.to_unit(chunk) for chunk in chunks)
        it = iter_frames(units)
        while True:
            t0 = time.perf_counter()
            frame = next(it, None)
            waited += time.perf_counter() - t0
            if frame is None:
                return
            yield frame

    t0 = time.perf_counter()
    with _atomic(out) as f:
        for data in encode_mp4(frames(), fps):
            f.write(data)
    timer.add("encode", time.perf_counter() - t0 - waited)
