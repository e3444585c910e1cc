"""The synchronous client: ``Client(url).decode(latent, model=...)`` -> encoded bytes."""

from __future__ import annotations

import io
import os
import time
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


class Client(BaseClient):
    """Decode latents (and encode pixels) against a running service (thread-safe; reuse one per process).

    ``timeout``: seconds per wait (connect, each read); ``deadline``: seconds for a whole call,
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
        progress: Progress = None,
        **params: Any,
    ) -> bytes | np.ndarray:
        """One latent -> encoded image/MP4 bytes, or numpy for ``tensor``/``frames``.

        ``latent``: a numpy array, a torch tensor, raw bytes (with ``shape``), or the path
        (``str`` or ``os.PathLike``) of a ``.npy`` / ``.safetensors`` file. ``params`` are
        the service's query params (``do_scaling``, ``scaling_factor``, ``shift_factor``,
        ``height``, ``width``, ``fps``, ``quality``, ``timestep``, ...). ``progress``: a
        callable ``(frames_received, frames_in_all)`` called as a video's answer streams in,
        or True for a bar on stderr (drawn only on a terminal).
        """
        req = build_request(latent, model, output, params, None)
        sink = sink_for(req.output)
        with reporting(progress, _label(model)) as report:
            self._send(req, sink, deadline, report)
        return sink.result()

    def decode_image(self, latent: Any, model: str | None = None, **params: Any) -> Any:
        """One latent -> a ``PIL.Image`` (PNG on the wire: lossless; needs Pillow)."""
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
        progress: Progress = None,
        **params: Any,
    ) -> Path:
        """Decode and write ``path`` (format from its suffix), streaming the body to disk;
        ``progress`` as ``decode``'s."""
        path = Path(path)
        output = output or output_for_path(path)
        if output_name(output) in ARRAY_OUTPUTS:
            array = self.decode(
                latent, model, output, deadline=deadline, progress=progress, **params
            )
            save_array(path, array)
            return path
        req = build_request(latent, model, output, params, None)
        with atomic_write(path) as f, reporting(progress, _label(model)) as report:
            self._send(req, FileSink(f), deadline, report)
        return path

    def encode(
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
        """Pixels -> the latent as numpy (``POST /encode/{model}``).

        ``image``: a PIL image (sent as PNG), PNG/JPEG/WebP/MP4 bytes or a path to such a
        file, or a float array ``[B,3,H,W]`` / ``[B,3,T,H,W]`` in [-1, 1] (sent raw). The
        latent is the distribution's mean, or a seeded sample (``sample=True, seed=N``);
        ``scaling_factor``/``shift_factor`` give ``(z - shift) * scale``, ``do_scaling`` the
        model's own normalisation, ``packed`` FLUX's packed layout."""
        params = encode_params(scaling_factor, shift_factor, do_scaling, sample, seed, packed)
        req = build_encode_request(image, model, params)
        sink = BufferSink()
        response = self._send(req, sink, deadline)
        return latent_response(req.output, sink.buffer, response.headers)

    def encode_to_file(
        self,
        image: Any,
        path: str | os.PathLike,
        model: str | None = None,
        *,
        deadline: float | None = None,
        **options: Any,
    ) -> Path:
        """Encode and write the latent to ``path``: ``.safetensors`` / ``.npy`` as the server
        writes them, ``.bin`` the raw bytes (its shape and dtype in ``last_call.headers``);
        ``options`` are ``encode``'s."""
        path = Path(path)
        req = build_encode_request(
            image, model, encode_params(**options), latent_format_for_path(path)
        )
        with atomic_write(path) as f:
            self._send(req, FileSink(f), deadline)
        return path

    def models(self) -> dict[str, Any]:
        return self._http.get("/models", headers=self._auth()).raise_for_status().json()

    def ready(self) -> bool:
        try:
            return self._http.get("/readyz", headers=self._auth(), timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def _send(
        self,
        req: Request,
        sink: Any,
        deadline: float | None,
        progress: ProgressCallback | None = None,
    ) -> httpx.Response:
        """POST until answered (retrying 429/503 and connection failures), the body into
        ``sink`` as it arrives (each attempt from its start), ``progress`` told the frames."""
        attempts = self._begin(deadline)
        reauthorized = False
        while True:
            attempts.count += 1
            token = self._current_token()
            try:
                with self._http.stream(
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
                        wait = self._refused(attempts, response, response.read(), req)
                    else:
                        self._check_answer(req, response)
                        reception = Reception(req.output, response.headers, sink, progress)
                        for chunk in response.iter_bytes():
                            attempts.check()
                            reception.feed(chunk)
                        reception.end()
                        self._finish(attempts, req, response)
                        return response
            except httpx.TimeoutException as exc:
                raise attempts.timed_out(exc) from None
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                wait = attempts.delay(None, self._unreachable(exc))
            time.sleep(wait)


def _label(model: str | None) -> str:
    return f"decoding with {model}" if model else "decoding"


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


def encode(
    image: Any, url: str = DEFAULT_URL, model: str | None = None, **options: Any
) -> np.ndarray:
    """One-shot ``Client(url).encode(...)``; keep a ``Client`` for repeated calls."""
    client_options = {
        k: options.pop(k) for k in ("timeout", "token", "max_retries") if k in options
    }
    with Client(url, **client_options) as client:
        return client.encode(image, model, **options)
