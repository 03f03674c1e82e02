"""Thin routes, one module per area. Every page is served at its path and, as JSON, at path + `.json`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse
from sqlalchemy.orm import Session


def get_session(request: Request) -> Iterator[Session]:
    """A read session on the app's database, closed after the response."""
    with request.app.state.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def page(router: APIRouter, path: str, name: str) -> Callable:
    """Register a page handler at `path` (HTML) and at its JSON twin (`path.json`, or `/.json` for `/`)."""

    def register(handler: Callable) -> Callable:
        twin = "/.json" if path == "/" else f"{path}.json"
        summary = (handler.__doc__ or name).strip().splitlines()[0]
        # The twin first: `{model}` would also match `name.json`.
        router.get(twin, name=f"{name}_json", summary=f"{summary} (JSON)")(handler)
        router.get(path, name=name, summary=summary, response_class=HTMLResponse)(handler)
        return handler

    return register


def action(router: APIRouter, path: str, name: str) -> Callable:
    """Register a form handler (POST) at `path` (answers with a redirect) and at `path.json`."""

    def register(handler: Callable) -> Callable:
        summary = (handler.__doc__ or name).strip().splitlines()[0]
        router.post(f"{path}.json", name=f"{name}_json", summary=f"{summary} (JSON)")(handler)
        router.post(path, name=name, summary=summary)(handler)
        return handler

    return register
