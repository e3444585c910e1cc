"""The routes: health, readiness, the model list, metrics, the decode and the encode routes,
the page for people (app/http/page.py) and the API docs (app/http/docs.py). What each route
takes and answers is described in app/http/openapi.py (``GET /openapi.json``)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from app.http.decode import handle_decode
from app.http.docs import install_docs
from app.http.encode import handle_encode
from app.http.openapi import install_openapi
from app.http.page import install_page
from app.http.serving import Serving
from app.runtime import Runtime


def install_routes(app: FastAPI, serving: Serving) -> None:
    runtime = serving.runtime  # the health, readiness and model routes read it

    @app.get("/healthz", summary="Process alive")
    @app.head("/healthz", include_in_schema=False)  # load balancers probe with HEAD too
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="200 once every model is resident and gated")
    @app.head("/readyz", include_in_schema=False)
    async def readyz(request: Request) -> JSONResponse:
        ready = runtime.ready and not serving.drain.draining
        body: dict[str, Any] = {"ready": ready}
        # a probe needs no token; what is loaded, and why one failed (store paths, the
        # device's error), only a caller with one (VAE_API_TOKENS)
        detailed = getattr(request.state, "authorized", True)
        if detailed:
            body |= {"models": sorted(runtime.models), "errors": runtime.errors}
            body["states"] = runtime.registry.describe_states()  # loading/gating/ready/failed
        else:
            body["details"] = "models, errors and states with Authorization: Bearer <token>"
        if not ready:
            body["reason"] = _not_ready(serving, detailed)
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/models", summary="Each model: family, config, device, dtype, parity, fallback")
    async def models() -> dict[str, Any]:
        return {
            "models": [_described(m.name, m.describe(), runtime) for m in runtime.models.values()],
            "errors": runtime.errors,
            "loading": runtime.loading,
            "states": runtime.registry.describe_states(),
            "default": serving.settings.default_model,
        }

    @app.get("/metrics", summary="Prometheus exposition")
    async def prometheus() -> Response:
        return Response(serving.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.post("/decode/{model}", summary="Decode one latent (batch allowed)")
    async def decode_named(model: str, request: Request) -> Response:
        return await handle_decode(request, model, serving)

    @app.post("/decode", summary="Decode with ?model= or VAE_DEFAULT_MODEL")
    async def decode_default(request: Request) -> Response:
        return await handle_decode(request, None, serving)

    @app.post("/encode/{model}", summary="Encode an image, video or pixel tensor to a latent")
    async def encode_named(model: str, request: Request) -> Response:
        return await handle_encode(request, model, serving)

    @app.post("/encode", summary="Encode with ?model= or VAE_DEFAULT_MODEL")
    async def encode_default(request: Request) -> Response:
        return await handle_encode(request, None, serving)

    install_page(app)  # GET / and its assets
    install_docs(app)  # GET /docs and its assets, in place of FastAPI's CDN pages
    install_openapi(app)  # GET /openapi.json: every route above as it answers


def _described(name: str, model: dict[str, Any], runtime: Runtime) -> dict[str, Any]:
    """A model's entry with its ``encoder`` (None: decoder-only; or the error that stops it)."""
    if name in runtime.encoders:
        encoder: dict[str, Any] | None = runtime.encoders[name].describe()
    elif name in runtime.encoder_errors:
        encoder = {"error": runtime.encoder_errors[name]}
    else:
        encoder = None
    return {**model, "encoder": encoder}


def _not_ready(serving: Serving, detailed: bool = True) -> str:
    runtime = serving.runtime
    if serving.drain.draining:
        return "draining: the service is shutting down"
    if runtime.loading:
        return "loading models and running parity gates"
    if runtime.device_lost:
        return f"device lost: {runtime.device_lost}" if detailed else "device lost"
    if runtime.worker_died:
        return "the decode worker has stopped"
    if runtime.errors and not detailed:
        return "a model is not served"
    if runtime.errors:
        return "; ".join(f"{k}: {v}" for k, v in runtime.errors.items())
    return "no model"
