"""Two runs side by side: the page of a pair (GET) and queuing its comparison (POST, a write)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse
from pydantic import BeforeValidator, Field

from ffmem.web import urls
from ffmem.web.deps import ModelDep, SessionDep
from ffmem.web.pages.compare import SORTS, CompareContext, compare_page, start_comparison
from ffmem.web.rendering import render
from ffmem.web.routes import action, page
from ffmem.web.wants import wants_json

router = APIRouter()
Sort = Literal[SORTS]  # the sorts of the key list


@page(router, "/m/{model}/compare", "compare", CompareContext)
def compare(
    request: Request,
    session: SessionDep,
    model: ModelDep,
    a: Annotated[
        int | None,
        Query(ge=1, le=2**31 - 1, description="Run a, of this model (default: its newest finished)."),
    ] = None,
    b: Annotated[
        int | None,
        Query(ge=1, le=2**31 - 1, description="Run b: any finished run whose model has run a's shape."),
    ] = None,
    sort: Annotated[Sort, Query(description="Which memories come first: the biggest change by …")] = "change",
    limit: Annotated[int, Query(ge=1, le=500, description="Memories listed.")] = 50,
    layer: Annotated[
        Annotated[int, Field(ge=0, le=10_000)] | None,
        BeforeValidator(lambda given: None if given == "" else given),  # the form's empty box: all layers
        Query(description="List only this layer's memories (empty: all)."),
    ] = None,
):
    """Two runs side by side: per memory the overlap of its top triggers, the change of its statistics and
    the cosine of its key and value between the runs' models, sorted by change."""
    found = compare_page(session, model, a, b, sort, limit, layer)
    return render(request, "compare.html", found)


@action(router, "/m/{model}/compare", "start_comparison", CompareContext, status=201)
def _start_comparison(
    request: Request,
    session: SessionDep,
    model: ModelDep,
    a: Annotated[int, Form(ge=1, le=2**31 - 1, description="Run a, of this model.")],
    b: Annotated[int, Form(ge=1, le=2**31 - 1, description="Run b, of a model of the same shape.")],
):
    """Queue the comparison of two runs (a worker computes it once per pair); an identical one is reused."""
    start_comparison(session, model, a, b)
    session.commit()
    if wants_json(request):
        found = compare_page(session, model, a, b, "change", 50, None)
        return JSONResponse(found.model_dump(mode="json"), status_code=201)
    return RedirectResponse(urls.compare_url(model.slug, a=a, b=b), status_code=303)
