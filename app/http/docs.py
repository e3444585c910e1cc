"""The API docs page, ``GET /docs``: Swagger UI on ``/openapi.json``, nothing from another origin.

FastAPI's own ``/docs`` loads Swagger UI from a CDN (an offline deployment shows a blank page)
and boots it with an inline script; its ``/redoc`` loads ReDoc and Google Fonts from CDNs. Here
Swagger UI's release files (``swagger-ui-bundle.js``, ``swagger-ui.css``) come from the
``fastapi-offline`` distribution (pinned in pyproject.toml: it vendors them as package data, and
nothing else of it is used), read once at startup and served under ``/docs/``; the page's
bootstrap is a file of its own (``/docs/init.js``), so the page's Content-Security-Policy
allows scripts, styles and fetches from this origin only (images also from ``data:``, the
icons inside Swagger UI's stylesheet, and ``blob:``, a try-it answer's image). ReDoc is not
served: its runtime needs inline styles and blob workers, and /docs describes the same schema.

Like ``/openapi.json``, the page and its assets need the bearer token when VAE_API_TOKENS is set
(``app.http.auth.OPEN_PATHS`` does not list them).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.routing import BaseRoute

SWAGGER_UI_PACKAGE = "fastapi_offline"  # its static/: Swagger UI's release files
DOCS_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data: blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
VENDORED = {  # served name -> media type; read from the package, never a path from a request
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
}
FASTAPI_DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc")  # replaced or dropped here

PAGE = """\
<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <meta name="viewport" content="width=device-width, initial-scale=1">
  <title>{title} - API</title>
  <link rel="icon" href="data:,">
  <link rel="stylesheet" href="/docs/swagger-ui.css">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="/docs/swagger-ui-bundle.js"></script>
  <script src="/docs/init.js"></script>
</body>
</html>
"""
# FastAPI's default Swagger UI parameters; validatorUrl null: no badge from validator.swagger.io
INIT = """\
// The docs page's bootstrap (app/http/docs.py): Swagger UI on this service's OpenAPI schema.
window.ui = SwaggerUIBundle({{
  url: {openapi_url},
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  deepLinking: true,
  showExtensions: true,
  showCommonExtensions: true,
  validatorUrl: null,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
}});
"""
ASSETS = {**VENDORED, "init.js": "text/javascript; charset=utf-8"}
DOCS_PATHS = frozenset({"/docs", *(f"/docs/{name}" for name in ASSETS)})


def vendored(name: str) -> bytes:
    return (files(SWAGGER_UI_PACKAGE) / "static" / name).read_bytes()


def install_docs(app: FastAPI) -> None:
    """``GET /docs`` and its three assets, in place of FastAPI's CDN pages."""
    app.router.routes[:] = [r for r in app.router.routes if not _fastapi_doc(r)]
    if not app.openapi_url:
        return
    page = PAGE.format(title=app.title).encode()
    assets = {name: (vendored(name), media) for name, media in VENDORED.items()}
    init = INIT.format(openapi_url=json.dumps(app.openapi_url)).encode()
    assets["init.js"] = (init, ASSETS["init.js"])
    headers = {"Content-Security-Policy": DOCS_CSP}

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=headers)

    for name, (body, media_type) in assets.items():
        app.add_api_route(
            f"/docs/{name}",
            _asset(body, media_type, headers),
            methods=["GET"],
            include_in_schema=False,
            name=f"docs:{name}",
        )


def _asset(
    body: bytes, media_type: str, headers: dict[str, str]
) -> Callable[[], Awaitable[Response]]:
    async def asset() -> Response:
        return Response(body, media_type=media_type, headers=headers)

    return asset


def _fastapi_doc(route: BaseRoute) -> bool:
    return getattr(route, "path", None) in FASTAPI_DOC_PATHS
