"""One error shape: `AppError(status, title, message)` → an HTML error page, or for `.json` paths
`{"ok": false, "error": …, "status": …}`. Unknown paths, malformed queries (400, not FastAPI's 422)
and anything unexpected (500, logged, no traceback shown) go through the same two renderings.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger("ffmem")


class AppError(Exception):
    """An error a person can act on: an HTTP status, a short title, and a message that says what to do."""

    def __init__(self, status: int, title: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.title, self.message = status, title, message
        self.headers = headers or {}  # e.g. Retry-After on a 503


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
        return error_response(request, AppError(400, "Bad request", _describe(error)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)
        message = "Something went wrong on our side; the error was logged."
        return error_response(request, AppError(500, "Internal error", message))


def error_response(request: Request, error: AppError) -> Response:
    """The JSON shape for `.json` paths, the error page otherwise."""
    from app.rendering import render_error  # the templates need the error module first

    return render_error(request, error)


def _describe(error: RequestValidationError) -> str:
    """FastAPI's validation errors as one readable sentence per bad parameter."""
    parts = []
    for problem in error.errors():
        where = ".".join(
            str(part) for part in problem.get("loc", ()) if part not in ("query", "path", "body")
        )
        parts.append(f"{where or 'request'}: {problem.get('msg', 'invalid')}")
    return "; ".join(parts) or "The request is malformed."
