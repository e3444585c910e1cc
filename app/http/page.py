"""The page for people: ``GET /`` (the models and a try-it form) and its two assets.

Plain HTML, one ES module, one stylesheet and an icon, shipped in the package (``app/http/page/``,
package data) and read once at startup; no build step, nothing from another origin. The page
and its assets are static and open (``app.http.auth.OPEN_PATHS``); the API calls the page makes
carry the token its visitor types in (kept in ``sessionStorage``). Each answer carries the
page's own Content-Security-Policy (the envelope's API policy, ``default-src 'none'``, is only
a default): scripts, styles and fetches from this origin only, images and video from this
origin or the ``blob:`` URLs of what the page decoded.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import Response

from app.http.errors import error_response

PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' blob:; media-src 'self' blob:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
ASSETS = {  # the only files served: no path from the request reaches the file system
    "page.js": "text/javascript; charset=utf-8",
    "page.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
# the page's paths, all open when VAE_API_TOKENS is set (auth.OPEN_PATHS lists them)
PAGE_PATHS = frozenset({"/", *(f"/page/{name}" for name in ASSETS)})


def _read(name: str) -> bytes:
    return (files("app.http") / "page" / name).read_bytes()


def install_page(app: FastAPI) -> None:
    index = _read("index.html")
    assets = {name: (_read(name), media_type) for name, media_type in ASSETS.items()}
    headers = {"Content-Security-Policy": PAGE_CSP}

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return Response(index, media_type="text/html; charset=utf-8", headers=headers)

    @app.get("/page/{asset}", include_in_schema=False)
    async def page_asset(asset: str) -> Response:
        if asset not in assets:
            return error_response(404, {"error": "no such page asset", "expected": "/"})
        body, media_type = assets[asset]
        return Response(body, media_type=media_type, headers=headers)
