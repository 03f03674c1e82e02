"""Search: memories by value token (both signs, over every memory's whole readout), sentences by text
(with the keys they trigger), or jump to `L12 K345`."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse

from ffmem.engine.live.protocol import MAX_SEARCH_MEMORIES
from ffmem.store.models import LanguageModel
from ffmem.web.deps import ModelDep, PinnedDep, SessionDep, SettingsDep
from ffmem.web.errors import AppError
from ffmem.web.pages.search import SearchContext, named_key, search_page
from ffmem.web.rendering import render
from ffmem.web.routes import page
from ffmem.web.wants import wants_fragment, wants_json

router = APIRouter()
MAX_LENGTH = 200  # the longest q accepted; the search box says so too (maxlength)


@page(router, "/m/{model}/search", "search", SearchContext, redirect="`q` names a key (L12 K345): its page.")
def search(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    model: ModelDep,
    pinned: PinnedDep,
    q: Annotated[
        str,
        Query(
            description="A token, text in trigger prefixes, or L12 K345.",
            json_schema_extra={"maxLength": MAX_LENGTH},  # checked below: the page shows why, its box kept
        ),
    ] = "",
    readout: Annotated[
        Literal["raw", "norm"], Query(description="Value readout: raw v·E or norm lm_head(final_norm(v)).")
    ] = "raw",
    by: Annotated[
        Literal["prob", "logit"],
        Query(description="Rank token matches by probability (softmax over the vocabulary) or logit."),
    ] = "prob",
    limit: Annotated[
        int,
        Query(
            ge=1,
            le=MAX_SEARCH_MEMORIES,
            description="Results per section. Token matches past the run's stored depth come from the live "
            "worker; without one, the stored ones (the JSON's `depth` says which, and why).",
        ),
    ] = 50,
):
    """Which memories promote or suppress a token (every memory ranked by the token's logit in its value's
    readout); which sentences contain a text, and the keys they trigger."""
    refused = refusal(model, q)
    if refused and (wants_json(request) or wants_fragment(request)):
        raise refused
    found = search_page(
        session,
        model,
        q=q[:MAX_LENGTH],
        pinned=pinned,
        readout=readout,
        by=by,
        limit=limit,
        max_length=MAX_LENGTH,
        jump=not wants_fragment(request),  # as you type: the results, with the key's link; sent: the key
        keys=refused is None,
        live=request.app.state.live,
        timeout=settings.search_worker_timeout,
    )
    if refused:  # the page, its box holding what fits, the reason next to it
        return render(
            request, "search.html", found, status_code=refused.status, field_errors={"q": refused.message}
        )
    if isinstance(found, str):  # q named a key: go there (its JSON twin for a JSON request)
        target = found.replace("?", ".json?", 1) if "?" in found else f"{found}.json"
        return RedirectResponse(target if wants_json(request) else found, status_code=303)
    return render(request, "search.html", found, fragment="results")


def refusal(model: LanguageModel, q: str) -> AppError | None:
    """Why `q` is refused (about the field `q`), or None: longer than MAX_LENGTH, or naming a key the model
    lacks (L12 K99999). The page shows it next to its search box, the box kept (Enter stays on the page)."""
    if len(q) > MAX_LENGTH:
        return AppError(
            400, "Bad request", f"q: String should have at most {MAX_LENGTH} characters", field="q"
        )
    try:
        named_key(model, q)
    except AppError as error:
        return error
    return None
