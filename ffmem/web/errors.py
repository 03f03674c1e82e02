"""One error shape: `AppError(status, title, message)` → an HTML error page, or for `.json` paths
`{"ok": false, "error": …, "status": …}`. Unknown paths, malformed queries (400, not FastAPI's 422)
and anything unexpected (500, logged, no traceback shown) go through the same two renderings. A
database that stops answering while we serve is a 503 with Retry-After, not a 500; the engine's
pre-ping pool reconnects once it is back.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger("ffmem")


class AppError(Exception):
    """An error a person can act on: an HTTP status, a short title, and a message that says what to do.

    `field`: the form field that caused it (a page shows the message next to that field, the page kept).
    `link`: (url, text) of the page to go to next; the error page links it, JSON gives it as `link`."""

    def __init__(
        self,
        status: int,
        title: str,
        message: str,
        headers: dict[str, str] | None = None,
        *,
        field: str | None = None,
        link: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.title, self.message = status, title, message
        self.headers = headers or {}  # e.g. Retry-After on a 503
        self.field = field
        self.link = link  # (url, text): where to go next, e.g. the page of the job building what was asked


def sentence(text: str) -> str:
    """An engine or worker message ("layer 3 does not exist") as a page's sentence ("Layer 3 … exist.")."""
    return f"{text[:1].upper()}{text[1:]}."


def install(app: FastAPI) -> None:
    """Route every error through `error_response`."""

    @app.exception_handler(AppError)
    async def app_error(request: Request, error: AppError) -> Response:
        return error_response(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        titles = {404: "Not found", 405: "Method not allowed"}
        message = "No page at this address." if error.status_code == 404 else str(error.detail)
        title = titles.get(error.status_code, "Error")
        return error_response(request, AppError(error.status_code, title, message))

    @app.exception_handler(RequestValidationError)
    async def bad_query(request: Request, error: RequestValidationError) -> Response:
        return error_response(request, AppError(400, "Bad request", _describe(error), field=_field(error)))

    @app.exception_handler(DBAPIError)
    async def database_error(request: Request, error: DBAPIError) -> Response:
        if not database_gone(error):
            return internal_error(request, error)
        reason = str(error.orig).strip().splitlines()[0] if error.orig is not None else type(error).__name__
        log.warning("the database is not answering (%s) on %s", reason, request.url.path)
        message = "The database is not answering; try again in a few seconds."
        gone = AppError(503, "Database unavailable", message, headers={"Retry-After": str(DATABASE_RETRY)})
        return error_response(request, gone)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Response:
        return internal_error(request, error)


DATABASE_RETRY = 5  # seconds a client waits before asking again when the database does not answer


def database_gone(error: DBAPIError) -> bool:
    """Whether `error` is the database going away (a lost or refused connection), not a bad query."""
    lost = error.connection_invalidated or error.statement is None  # no statement: while connecting
    return isinstance(error, (OperationalError, InterfaceError)) and lost


def internal_error(request: Request, error: Exception) -> Response:
    """A 500 in the error shape; the traceback goes to the log only."""
    log.error("unexpected error on %s", request.url.path, exc_info=error)
    message = "Something went wrong on our side; the error was logged."
    return error_response(request, AppError(500, "Internal error", message))


def error_response(request: Request, error: AppError) -> Response:
    """The JSON shape for `.json` paths, the error page otherwise."""
    from ffmem.web.rendering import render_error  # the templates need the error module first

    return render_error(request, error)


def _field(error: RequestValidationError) -> str | None:
    """The parameter of the first problem (`q`, `pattern`), for a page to show the message next to it."""
    problems = error.errors()
    if not problems:
        return None
    where = [str(part) for part in problems[0].get("loc", ()) if part not in ("query", "path", "body")]
    return where[0] if where else None


def _describe(error: RequestValidationError) -> str:
    """FastAPI's validation errors as one readable sentence per bad parameter."""
    parts = []
    for problem in error.errors():
        where = ".".join(
            str(part) for part in problem.get("loc", ()) if part not in ("query", "path", "body")
        )
        parts.append(f"{where or 'request'}: {problem.get('msg', 'invalid')}")
    return "; ".join(parts) or "The request is malformed."
