"""Every error the app meets answered in the one error shape (ffmem/web/errors.py, rendered by
ffmem/web/rendering.py): an AppError as it is; unknown paths and other HTTP errors (a 405 with the `Allow`
header of every route at its path); malformed queries as a 400, not FastAPI's 422 (a bad `?run=` links the
page on its default run); a database that stops answering while we serve as a 503 with Retry-After, not a 500
(the engine's pre-ping pool reconnects once it is back); anything unexpected as a 500, logged, no traceback
shown.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from ffmem.web.errors import AppError, describe, field_of
from ffmem.web.rendering import render_error

log = logging.getLogger("ffmem")


def install(app: FastAPI) -> None:
    """Route every error through `error_response`."""

    @app.exception_handler(AppError)
    async def app_error(request: Request, error: AppError) -> Response:
        return render_error(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        titles = {404: "Not found", 405: "Method not allowed"}
        message = "No page at this address." if error.status_code == 404 else str(error.detail)
        title = titles.get(error.status_code, "Error")
        headers = dict(error.headers or {})
        if error.status_code == 405:
            headers["Allow"] = allowed_methods(request, headers.get("Allow", ""))
        return render_error(request, AppError(error.status_code, title, message, headers))

    @app.exception_handler(RequestValidationError)
    async def bad_query(request: Request, error: RequestValidationError) -> Response:
        field = field_of(error)
        link = default_run_link(request) if field == "run" and "run" in request.query_params else None
        return render_error(request, AppError(400, "Bad request", describe(error), field=field, link=link))

    @app.exception_handler(DBAPIError)
    async def database_error(request: Request, error: DBAPIError) -> Response:
        if not database_gone(error):
            return internal_error(request, error)
        reason = str(error.orig).strip().splitlines()[0] if error.orig is not None else type(error).__name__
        log.warning("the database is not answering (%s) on %s", reason, request.url.path)
        message = "The database is not answering; try again in a few seconds."
        gone = AppError(503, "Database unavailable", message, headers={"Retry-After": str(DATABASE_RETRY)})
        return render_error(request, gone)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Response:
        return internal_error(request, error)


DATABASE_RETRY = 5  # seconds a client waits before asking again when the database does not answer


def allowed_methods(request: Request, allow: str) -> str:
    """The `Allow` header of a 405: the methods of every route at the request's path (Starlette names only
    the first route's: a path with a page and a form, GET and POST, is two routes) and those of `allow`; HEAD
    wherever GET is (main.HeadAsGet answers it)."""
    methods = {method.strip() for method in allow.split(",") if method.strip()}
    for route in flat_routes(request.app.router.routes):
        if getattr(route, "methods", None) and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods))


def flat_routes(routes: list) -> Iterator:
    """Every route of `routes`, those of included routers too (FastAPI keeps an included router whole, as
    one entry holding `original_router`; ours are included without a prefix)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        yield from flat_routes(included.routes) if included is not None else (route,)


def default_run_link(request: Request) -> tuple[str, str]:
    """The page a malformed `?run=` was asked of, on its default run (the newest): the same URL without it."""
    kept = [(name, value) for name, value in request.query_params.multi_items() if name != "run"]
    path = request.url.path
    return (f"{path}?{urlencode(kept)}" if kept else path), "the same page on the newest run"


def database_gone(error: DBAPIError) -> bool:
    """Whether `error` is the database going away (a lost or refused connection), not a bad query."""
    lost = error.connection_invalidated or error.statement is None  # no statement: while connecting
    return isinstance(error, (OperationalError, InterfaceError)) and lost


def internal_error(request: Request, error: Exception) -> Response:
    """A 500 in the error shape; the traceback goes to the log only."""
    log.error("unexpected error on %s", request.url.path, exc_info=error)
    message = "Something went wrong on our side; the error was logged."
    return render_error(request, AppError(500, "Internal error", message))
