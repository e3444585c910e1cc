"""The HTTP service: FastAPI over the runtime, one module per role.

request -> envelope (request id, safe headers) -> auth -> route -> decode handler
(protocol -> queue -> worker) -> response (image / tensor / streamed MP4) -> accounting.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI

from app.config import Settings
from app.http.auth import BearerAuth
from app.http.budget import BodyBudget
from app.http.drain import STOP_S, Drain, route_sigterm
from app.http.envelope import Envelope
from app.http.errors import install_error_handlers
from app.http.routes import install_routes
from app.http.serving import Serving
from app.runtime import Runtime
from app.telemetry.metrics import Metrics

__all__ = ["create_app"]


def create_app(settings: Settings | None = None, *, load_in_background: bool = True) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    runtime = Runtime(settings, metrics)
    drain = Drain(settings.drain_grace_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.threads:
            torch.set_num_threads(settings.threads)
        runtime.start()
        restore = route_sigterm(drain)
        if threading.current_thread() is threading.main_thread():  # a process of its own
            _freeze_startup_objects()
            # a sticky device error: drain (queued requests get 503) and exit, so the
            # platform replaces this instance
            runtime.on_device_lost = lambda reason: os.kill(os.getpid(), signal.SIGTERM)
        loader = threading.Thread(target=runtime.load_all, name="model-loader", daemon=True)
        if load_in_background:
            loader.start()
        else:
            runtime.load_all()
        yield
        restore()
        runtime.stop(timeout=_stop_timeout(drain))
        if loader.is_alive():  # measuring modes after ready: it stops after the part at hand
            loader.join(_stop_timeout(drain))

    app = FastAPI(
        title="VAE render service",
        version="0.1.0",
        summary="Latents in, pixels out: resident VAE decoders behind remote_decode's protocol.",
        lifespan=lifespan,
    )
    app.state.runtime, app.state.metrics, app.state.settings = runtime, metrics, settings
    app.state.drain = drain
    app.state.bodies = BodyBudget(settings.bodies_mb << 20)
    app.router.redirect_slashes = False  # Starlette's builds Location from Host: see errors.py
    # the last added is the outermost: the envelope also wraps auth's 401s
    app.add_middleware(
        BearerAuth, tokens=settings.tokens(), protect_metrics=settings.protect_metrics
    )
    app.add_middleware(Envelope)
    install_error_handlers(app)
    install_routes(app, Serving(runtime, metrics, settings, drain))
    return app


def _freeze_startup_objects() -> None:
    """What the imports made (torch's, the service's: nearly every object the process will
    hold) out of the cyclic collector's reach. A full collection walks every object it
    tracks, and stops every thread while it does, the event loop's included, mid-request
    (README, "The collector"); frozen, it walks only what came after. Before any request or
    model load, so nothing a request or a load drops is ever frozen (a frozen cycle would
    never be collected)."""
    gc.collect()
    gc.freeze()


def _stop_timeout(drain: Drain) -> float:
    """How long the lifespan's shutdown waits for the decode worker: after a drain that ran
    out, not at all (it may still be decoding work already answered 503, and cannot be
    interrupted); else what is left of the SIGTERM's deadline (10 s without one)."""
    if drain.expired.is_set():
        return 0.0
    left = drain.left(STOP_S / 2)
    return 10.0 if left is None else min(10.0, left)
