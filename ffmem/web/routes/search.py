"""Search: memories by value token (both signs), trigger prefixes by text, or jump to `L12 K345`."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse

from ffmem.web import pages
from ffmem.web.contexts import SearchContext
from ffmem.web.rendering import render, wants_json
from ffmem.web.routes import SessionDep, page
from ffmem.web.routes.models import RunQuery

router = APIRouter()


@page(router, "/m/{model}/search", "search", SearchContext, redirect="`q` names a key (L12 K345): its page.")
def search(
    request: Request,
    session: SessionDep,
    model: str,
    q: Annotated[
        str, Query(max_length=200, description="A token, text in trigger prefixes, or L12 K345.")
    ] = "",
    run: RunQuery = None,
    readout: Annotated[Literal["raw", "norm"], Query(description="Value readout: raw v·E or norm.")] = "raw",
    by: Annotated[Literal["prob", "logit"], Query(description="Rank token matches by.")] = "prob",
    limit: Annotated[int, Query(ge=1, le=200, description="Results per section.")] = 50,
):
    """Which memories promote or suppress a token; which trigger prefixes contain a text."""
    found = pages.search_page(session, model, q=q, run_id=run, readout=readout, by=by, limit=limit)
    if isinstance(found, str):  # q named a key: go there (its JSON twin for a JSON request)
        target = found.replace("?", ".json?", 1) if "?" in found else f"{found}.json"
        return RedirectResponse(target if wants_json(request) else found, status_code=303)
    return render(request, "search.html", found, fragment="results")
