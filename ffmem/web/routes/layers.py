"""The layer page: every key of one layer, paged, sortable, filterable by a value token."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse

from ffmem.store import layer_table
from ffmem.web import urls
from ffmem.web.deps import LayerDep, ModelDep, PinnedDep, RunDep, SessionDep
from ffmem.web.errors import AppError
from ffmem.web.lookups import check_key
from ffmem.web.pages.layer import LayerContext, layer_page
from ffmem.web.rendering import render
from ffmem.web.routes import page
from ffmem.web.wants import wants_fragment, wants_json

router = APIRouter()
Sort = Literal[layer_table.KEY_SORTS]  # the columns the layer table sorts by


@page(
    router,
    "/m/{model}/layers/{layer}",
    "layer",
    LayerContext,
    redirect="`key` names a key of the layer: its page.",
)
def layer(
    request: Request,
    session: SessionDep,
    model: ModelDep,
    layer: LayerDep,
    run: RunDep,
    pinned: PinnedDep,
    sort: Annotated[Sort, Query(description="Column to sort the keys by.")] = "key",
    order: Annotated[Literal["asc", "desc"], Query(description="Sort direction.")] = "asc",
    token: Annotated[
        str | None, Query(max_length=200, description="Keep keys whose value promotes this token.")
    ] = None,
    page_number: Annotated[int, Query(alias="page", ge=1, le=100_000, description="Page, from 1.")] = 1,
    per_page: Annotated[int, Query(ge=1, le=500, description="Keys per page.")] = 50,
    key: Annotated[
        int | None,
        Query(ge=0, le=2**31 - 1, description="Open this key of the layer (a redirect to its page)."),
    ] = None,
):
    """One layer: its keys with their top trigger, value tokens and statistics."""
    refused = None
    if key is not None:  # the page's "open key" box: at 14,336 keys a layer, paging to one is no way there
        try:
            check_key(model, layer, key)
        except AppError as error:
            if wants_json(request) or wants_fragment(request):
                raise
            refused = error  # the page, the reason next to its box (Enter stays on the page)
        else:
            fmt = "json" if wants_json(request) else None
            return RedirectResponse(urls.key_url(model.slug, layer, key, fmt, run=pinned), status_code=303)
    ctx = layer_page(
        session,
        model,
        run,
        layer,
        pinned=pinned,
        sort=sort,
        order=order,
        token=token or None,
        page=page_number,
        per_page=per_page,
    )
    if refused:
        return render(request, "layer.html", ctx, status_code=404, field_errors={"key": refused.message})
    return render(request, "layer.html", ctx, fragment="keys")
