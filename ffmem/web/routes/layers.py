"""The layer page: every key of one layer, paged, sortable, filterable by a value token."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request

from ffmem.store import queries
from ffmem.web import pages
from ffmem.web.contexts import LayerContext
from ffmem.web.rendering import render
from ffmem.web.routes import SessionDep, page
from ffmem.web.routes.models import RunQuery

router = APIRouter()
Sort = Literal[queries.KEY_SORTS]  # the columns the layer table sorts by


@page(router, "/m/{model}/layers/{layer}", "layer", LayerContext)
def layer(
    request: Request,
    session: SessionDep,
    model: str,
    layer: int,
    run: RunQuery = None,
    sort: Annotated[Sort, Query(description="Column to sort the keys by.")] = "key",
    order: Annotated[Literal["asc", "desc"], Query(description="Sort direction.")] = "asc",
    token: Annotated[
        str | None, Query(max_length=200, description="Keep keys whose value promotes this token.")
    ] = None,
    page_number: Annotated[int, Query(alias="page", ge=1, le=100_000, description="Page, from 1.")] = 1,
    per_page: Annotated[int, Query(ge=1, le=500, description="Keys per page.")] = 50,
):
    """One layer: its keys with their top trigger, value tokens and statistics."""
    ctx = pages.layer_page(
        session,
        model,
        layer,
        run_id=run,
        sort=sort,
        order=order,
        token=token or None,
        page=page_number,
        per_page=per_page,
    )
    return render(request, "layer.html", ctx, fragment="keys")
