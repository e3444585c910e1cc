"""The asyncio client: ``await AsyncClient(url).decode(latent, model=...)``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from vae_client.answers import BufferSink, FileSink, ProgressCallback, Reception, sink_for
from vae_client.base import DEFAULT_URL, BaseClient
from vae_client.files import atomic_write, save_array
from vae_client.progress import Progress, reporting
from vae_client.wire import (
    ARRAY_OUTPUTS,
    Request,
    build_encode_request,
    build_request,
    encode_params,
    latent_format_for_path,
    latent_response,
    output_for_path,
    output_name,
)


class AsyncClient(BaseClient):
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
        progress: Progress = None,
        **params: Any,
    ) -> bytes | np.ndarray:
        """``Client.decode`` awaited (``progress`` is called in the event loop)."""
        req = build_request(latent, model, output, params, None)
        sink = sink_for(req.output)
        with reporting(progress, _label(model)) as report:
            await self._send(req, sink, deadline, report)
        return sink.result()

    async def decode_to_file(
        self,
        latent: Any,
        path: str | os.PathLike,
        model: str | None = None,
        output: str | None = None,
        *,
        deadline: float | None = None,
        progress: Progress = None,
        **params: Any,
    ) -> Path:
        """``Client.decode_to_file`` awaited."""
        path = Path(path)
        output = output or output_for_path(path)
        if output_name(output) in ARRAY_OUTPUTS:
            array = await self.decode(
                latent, model, output, deadline=deadline, progress=progress, **params
            )
            save_array(path, array)
            return path
        req = build_request(latent, model, output, params, None)
        with atomic_write(path) as f, reporting(progress, _label(model)) as report:
            await self._send(req, FileSink(f), deadline, report)
        return path

    async def encode(
        self,
        image: Any,
        model: str | None = None,
        *,
        scaling_factor: float | None = None,
        shift_factor: float | None = None,
        do_scaling: bool = False,
        sample: bool = False,
        seed: int | None = None,
        packed: bool = False,
        deadline: float | None = None,
    ) -> np.ndarray:
        """``Client.encode`` awaited: pixels -> the latent as numpy."""
        params = encode_params(scaling_factor, shift_factor, do_scaling, sample, seed, packed)
        req = build_encode_request(image, model, params)
        sink = BufferSink()
        response = await self._send(req, sink, deadline)
        return latent_response(req.output, sink.buffer, response.headers)

    async def encode_to_file(
        self,
        image: Any,
        path: str | os.PathLike,
        model: str | None = None,
        *,
        deadline: float | None = None,
        **options: Any,
    ) -> Path:
        path = Path(path)
        req = build_encode_request(
            image, model, encode_params(**options), latent_format_for_path(path)
        )
        with atomic_write(path) as f:
            await self._send(req, FileSink(f), deadline)
        return path

    async def _send(
        self,
        req: Request,
        sink: Any,
        deadline: float | None,
        progress: ProgressCallback | None = None,
    ) -> httpx.Response:
        """``Client._send`` with awaits: the same retries, waits and deadline."""
        attempts = self._begin(deadline)
        reauthorized = False
        while True:
            attempts.count += 1
            token = await self._current_token_async()
            try:
                async with self._http.stream(
                    "POST",
                    req.path,
                    params=req.params,
                    headers={**req.headers, **self._auth(token)},
                    content=req.body,
                    timeout=attempts.timeout(),
                ) as response:
                    attempts.last_status = response.status_code
                    if self._retry_unauthorized(response.status_code, token, reauthorized):
                        reauthorized = True  # at once, with the provider's next token
                        continue
                    if response.status_code >= 400:
                        wait = self._refused(attempts, response, await response.aread(), req)
                    else:
                        self._check_answer(req, response)
                        reception = Reception(req.output, response.headers, sink, progress)
                        async for chunk in response.aiter_bytes():
                            attempts.check()
                            reception.feed(chunk)
                        reception.end()
                        self._finish(attempts, req, response)
                        return response
            except httpx.TimeoutException as exc:
                raise attempts.timed_out(exc) from None
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                wait = attempts.delay(None, self._unreachable(exc))
            await asyncio.sleep(wait)


def _label(model: str | None) -> str:
    return f"decoding with {model}" if model else "decoding"
