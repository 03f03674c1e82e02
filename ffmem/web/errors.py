"""One error shape: `AppError(status, title, message)` → an HTML error page, or for `.json` paths
`{"ok": false, "error": …, "status": …}` (ffmem/web/rendering.py renders it; ffmem/web/error_handlers.py
routes every error there); and what a malformed request's problems say.
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError


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


def field_of(error: RequestValidationError) -> str | None:
    """The parameter of the first problem (`q`, `pattern`), for a page to show the message next to it."""
    problems = error.errors()
    if not problems:
        return None
    where = [str(part) for part in problems[0].get("loc", ()) if part not in ("query", "path", "body")]
    return where[0] if where else None


def describe(error: RequestValidationError) -> str:
    """FastAPI's validation errors as one readable sentence per bad parameter (once: a parameter two
    dependencies read, such as `run`, is reported by each)."""
    parts = []
    for problem in error.errors():
        where = ".".join(
            str(part) for part in problem.get("loc", ()) if part not in ("query", "path", "body")
        )
        parts.append(f"{where or 'request'}: {problem.get('msg', 'invalid')}")
    return "; ".join(dict.fromkeys(parts)) or "The request is malformed."
