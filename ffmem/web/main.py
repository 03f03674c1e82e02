"""create_app(settings): routers, static files, error handlers, security headers and size limits, a
Server-Timing header — wiring only."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ffmem.config import Settings, get_settings
from ffmem.store.db import Retry, make_engine, make_sessionmaker
from ffmem.web import error_handlers, routes, security
from ffmem.web.rendering import templates
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


class ServerTiming:
    """The time from a request's arrival to its response's start, as a Server-Timing header (`app;dur=`
    milliseconds). Plain ASGI: Starlette's BaseHTTPMiddleware cost ~1 ms a request in task switching."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()

        async def timed(message: Message) -> None:
            if message["type"] == "http.response.start":
                duration = f"app;dur={1000 * (time.perf_counter() - start):.2f}"
                MutableHeaders(scope=message).append("Server-Timing", duration)
            await send(message)

        await self.app(scope, receive, timed)


class HeadAsGet:
    """HEAD answered as GET without its body (the routes are GET routes; HTTP wants HEAD wherever GET
    is, and link checkers and monitors use it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


def create_app(
    settings: Settings | None = None, live: LiveWorker | None = None, local_worker: bool = False
) -> FastAPI:
    """The explorer over `settings.database_url`; live traces go to `live` (default: settings.worker_url).
    `local_worker`: the serving process started its own worker (`ffmem serve`), which takes queued jobs."""
    settings = settings or get_settings()
    app = FastAPI(
        title="ffmem",
        description="Explore the key-value memories inside transformer feed-forward layers.",
        version="0.1.0",
        docs_url=None,  # FastAPI's docs load Swagger UI from a CDN, with an inline script: /docs below
        redoc_url=None,
    )
    engine = make_engine(settings.database_url, Retry.from_settings(settings))
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = make_sessionmaker(engine)
    app.state.live = live or LiveWorker(settings.worker_url, settings.worker_timeout)
    app.state.local_worker = local_worker
    app.mount("/static", CachedStatic(directory=STATIC), name="static")
    for module in (models, layers, keys, compare, search, jobs, corpora, trace, access):
        app.include_router(module.router)
    app.openapi = routes.openapi(app)  # without FastAPI's 422: malformed input is a 400 here

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> FileResponse:
        """Browsers ask for it on a first visit (pages link static/favicon.svg)."""
        return FileResponse(STATIC / "favicon.ico", headers={"Cache-Control": "public, max-age=86400"})

    @app.get("/docs", include_in_schema=False)
    def docs(request: Request) -> HTMLResponse:
        """Every route, from /openapi.json, in the vendored Swagger UI (static/vendor, static/docs.js)."""
        return templates.TemplateResponse(request, "docs.html", {"openapi_url": app.openapi_url})

    error_handlers.install(app)

    app.add_middleware(ServerTiming)
    app.add_middleware(HeadAsGet)
    security.install(app, settings)
    return app
