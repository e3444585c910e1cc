"""The HTTP service's entry point (``uvicorn app.service:create_app``); the roles live in
``app/http/``: the app and middleware, routes, the decode handler, responses (MP4 included),
the request's metrics and log, and the errors' one mapping."""

from __future__ import annotations

from app.http import create_app

__all__ = ["create_app"]
