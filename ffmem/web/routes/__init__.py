"""Thin routes, one module per area: each takes its lookups resolved (ffmem/web/deps.py), asks a page
builder (ffmem/web/pages/) for the context and renders it. Every page is served at its path and, as JSON, at
path + `.json`.

`page()` and `action()` register both and document them in the OpenAPI document once for all
routes: the success answer (the page's context model on the JSON twin) and every error the app may
answer with, in its one shape (`ErrorBody` on `.json` paths, an HTML error page otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import BaseModel, ConfigDict, Field

from ffmem.web.access import require_write


class ErrorBody(BaseModel):
    """The one error shape of `.json` paths (ffmem/web/errors.py)."""

    model_config = ConfigDict(extra="forbid")

    ok: Literal[False] = Field(description="Always false on an error.")
    error: str = Field(description="What went wrong and what to do about it.")
    status: int = Field(description="The HTTP status of the answer.")
    link: str = Field(None, description="Where to go next, given when there is a page for it (a job's, say).")


RETRY_AFTER = {
    "Retry-After": {"description": "Seconds to wait before asking again.", "schema": {"type": "string"}}
}
# What each error means; every route may answer the first group, writes and live routes more.
ERRORS = {
    400: "Bad input: a malformed or out-of-range parameter; the message names it and what is allowed.",
    404: "No such page, model, run, layer, key or job; the message gives the valid range or names.",
    413: "The request body is larger than the server accepts.",
    414: "The query string is longer than the server accepts.",
    503: "The database is not answering, or the index asked for is being built (`link`: its job); try again "
    "after Retry-After seconds.",
}
WRITE_ERRORS = {
    401: "A write without the admin token.",
    403: "A write with a wrong admin token.",
    409: "The request conflicts with the current state (e.g. retrying a job that has not failed).",
}
LIVE_ERRORS = {
    429: "Too many live requests from this client; try again after Retry-After seconds.",
    502: "The live worker failed on this request.",
    503: "The database or the live worker is not answering, or the worker is busy or loading its model; "
    "try again after Retry-After seconds.",
    504: "The live worker did not answer in time.",
}


def _errors(codes: dict[int, str], media: str) -> dict[int | str, dict]:
    """OpenAPI `responses` for `codes`: ErrorBody on JSON paths, an HTML page otherwise."""
    responses: dict[int | str, dict] = {}
    for code, description in sorted(codes.items()):
        documented: dict = {"description": description}
        if media == "json":
            documented["model"] = ErrorBody
        else:
            documented["content"] = {"text/html": {"schema": {"type": "string"}}}
        if code in (429, 503):
            documented["headers"] = RETRY_AFTER
        responses[code] = documented
    return responses


def page(
    router: APIRouter,
    path: str,
    name: str,
    context: type[BaseModel] | None = None,
    *,
    live: bool = False,
    redirect: str | None = None,
) -> Callable:
    """Register a page handler at `path` (HTML) and at its JSON twin (`path.json`, or `/.json` for `/`).

    `context`: the JSON twin's body; `live`: the route asks the live worker (and is rate limited);
    `redirect`: when the page answers 303 instead, and where to."""
    codes = ERRORS | (LIVE_ERRORS if live else {})

    def register(handler: Callable) -> Callable:
        twin = "/.json" if path == "/" else f"{path}.json"
        summary = (handler.__doc__ or name).strip().splitlines()[0]
        extra = {303: {"description": redirect}} if redirect else {}
        ok = {200: {"model": context}} if context else {}
        # The twin first: `{model}` would also match `name.json`.
        router.get(
            twin,
            name=f"{name}_json",
            summary=f"{summary} (JSON)",
            responses=ok | extra | _errors(codes, "json"),
        )(handler)
        router.get(
            path,
            name=name,
            summary=summary,
            response_class=HTMLResponse,
            responses=extra | _errors(codes, "html"),
        )(handler)
        return handler

    return register


def posted_page(router: APIRouter, path: str, name: str, context: type[BaseModel]) -> Callable:
    """Register a live page's form twin: POST at `path` (the page) and `path.json` (its context), the
    same answer as the GET with its fields in the body — a prompt or text too long for a URL. A read:
    no write access needed (read-only servers too), rate limited as the GET."""
    codes = ERRORS | LIVE_ERRORS

    def register(handler: Callable) -> Callable:
        summary = (handler.__doc__ or name).strip().splitlines()[0]
        router.post(
            f"{path}.json",
            name=f"{name}_json",
            summary=f"{summary} (JSON)",
            responses={200: {"model": context}} | _errors(codes, "json"),
        )(handler)
        router.post(
            path, name=name, summary=summary, response_class=HTMLResponse, responses=_errors(codes, "html")
        )(handler)
        return handler

    return register


def action(
    router: APIRouter,
    path: str,
    name: str,
    context: type[BaseModel] | None = None,
    *,
    status: int = 200,
    writes: bool = True,
    errors: dict[int, str] | None = None,
) -> Callable:
    """Register a form handler (POST) at `path` (answers with a 303 redirect) and at `path.json` (answers
    `status` with `context`). An action that `writes` needs write access (ffmem/web/access.py); `errors`:
    what else it may answer."""
    codes = ERRORS | (WRITE_ERRORS if writes else {}) | (errors or {})
    guard = [Depends(require_write)] if writes else []

    def register(handler: Callable) -> Callable:
        summary = (handler.__doc__ or name).strip().splitlines()[0]
        ok = {status: {"model": context}} if context else {}
        router.post(
            f"{path}.json",
            name=f"{name}_json",
            summary=f"{summary} (JSON)",
            status_code=status,
            responses=ok | _errors(codes, "json"),
            dependencies=guard,
        )(handler)
        router.post(
            path,
            name=name,
            summary=summary,
            status_code=303,
            response_class=RedirectResponse,
            responses=_errors(codes, "html"),
            dependencies=guard,
        )(handler)
        return handler

    return register


def openapi(app: FastAPI) -> Callable[[], dict]:
    """The app's OpenAPI document without FastAPI's 422: malformed input is a 400 here (ffmem/web/errors.py).
    Install with `app.openapi = openapi(app)`."""
    build = app.openapi

    def document() -> dict:
        if app.openapi_schema is None:
            built = build()
            for item in built["paths"].values():
                for operation in item.values():
                    operation.get("responses", {}).pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                built.get("components", {}).get("schemas", {}).pop(unused, None)
            app.openapi_schema = built
        return app.openapi_schema

    return document
