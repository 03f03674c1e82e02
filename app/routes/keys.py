"""The key page: trigger prefixes, the value's tokens, the histogram and key–value agreement."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from app import pages
from app.rendering import render
from app.routes import SessionDep, page
from app.routes.models import RunQuery

router = APIRouter()


@page(router, "/m/{model}/layers/{layer}/keys/{key}", "key")
def key(
    request: Request,
    session: SessionDep,
    model: str,
    layer: int,
    key: int,
    run: RunQuery = None,
    triggers: Annotated[int, Query(ge=1, le=1000, description="Trigger prefixes shown per sign.")] = 25,
):
    """One memory: its key's trigger prefixes and its value's vocabulary distribution."""
    ctx = pages.key_page(session, model, layer, key, run_id=run, limit=triggers)
    return render(request, "key.html", ctx, fragment="triggers")
