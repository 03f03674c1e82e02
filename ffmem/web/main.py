"""create_app(settings): routers, static files, error handlers, security headers and size limits, a
Server-Timing header — wiring only."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from ffmem.config import Settings, get_settings
from ffmem.store.db import Retry, make_engine, make_sessionmaker
from ffmem.web import errors, routes, security
from ffmem.web.routes import access, compare, corpora, jobs, keys, layers, models, search, trace
from ffmem.web.worker_client import LiveWorker

STATIC = Path(__file__).resolve().parent / "static"


class CachedStatic(StaticFiles):
    """Static files; vendored ones (versioned names) are cached for a year."""

    def file_response(self, full_path, stat_result, scope, status_code=200):
        response = super().file_response(full_path, stat_result, scope, status_code)
        vendored = "/vendor/" in str(full_path)
        response.headers["Cache-Control"] = "public, max-age=31536000, immutable" if vendored else "no-cache"
        return response


def create_app(settings: Settings | None = None, live: LiveWorker | None = None) -> FastAPI:
    """The explorer over `settings.database_url`; live traces go to `live` (default: settings.worker_url)."""
    settings = settings or get_settings()
    app = FastAPI(
        title="ffmem",
        description="Explore the key-value memories inside transformer feed-forward layers.",
        version="0.1.0",
    )
    engine = make_engine(settings.database_url, Retry.from_settings(settings))
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = make_sessionmaker(engine)
    app.state.live = live or LiveWorker(settings.worker_url, settings.worker_timeout)
    app.mount("/static", CachedStatic(directory=STATIC), name="static")
    for module in (models, layers, keys, compare, search, jobs, corpora, trace, access):
        app.include_router(module.router)
    app.openapi = routes.openapi(app)  # without FastAPI's 422: malformed input is a 400 here

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> FileResponse:
        """Browsers ask for it on a first visit (pages link static/favicon.svg)."""
        return FileResponse(STATIC / "favicon.ico", headers={"Cache-Control": "public, max-age=86400"})

    errors.install(app)

    @app.middleware("http")
    async def server_timing(request: Request, call_next):
        start = time.perf_counter()
        response = await call_next(request)
        response.headers["Server-Timing"] = f"app;dur={1000 * (time.perf_counter() - start):.2f}"
        return response

    security.install(app, settings)
    return app
