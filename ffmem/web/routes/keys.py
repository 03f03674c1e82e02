"""The key page: trigger prefixes, the value's tokens, the histogram and key–value agreement."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Path, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from ffmem.store import queries
from ffmem.web import pages, urls
from ffmem.web.access import admin_name, remember_author
from ffmem.web.contexts import KeyContext, LabelAnswer, LabelDeleted
from ffmem.web.errors import AppError
from ffmem.web.rendering import render, wants_fragment, wants_json
from ffmem.web.routes import SessionDep, action, page
from ffmem.web.routes.models import RunQuery

router = APIRouter()


@page(router, "/m/{model}/layers/{layer}/keys/{key}", "key", KeyContext)
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


@action(router, "/m/{model}/layers/{layer}/keys/{key}/labels", "label_key", LabelAnswer, status=201)
def label(
    request: Request,
    session: SessionDep,
    model: str,
    layer: int,
    key: int,
    pattern: Annotated[str, Form(max_length=500, description="What the trigger prefixes share.")] = "",
    tag: Annotated[Literal["shallow", "semantic", ""], Form(description="shallow, semantic or none.")] = "",
    author: Annotated[
        str, Form(max_length=100, description="Who labels it (default: the name given at /login).")
    ] = "",
):
    """Label a memory (a pattern description and a shallow/semantic tag); earlier labels stay as history."""
    found = pages.model_or_404(session, model)
    pages.check_key(found, layer, key)
    pattern, author = pattern.strip(), author.strip() or admin_name(request) or ""
    if not pattern and not tag:
        raise AppError(
            400,
            "Empty label",
            "Give a pattern description, a tag (shallow or semantic), or both.",
            field="pattern",
        )
    added = queries.add_label(
        session=session,
        model_id=found.id,
        layer=layer,
        key=key,
        pattern=queries.stored_text(pattern),
        tag=tag,
        author=queries.stored_text(author),
    )
    session.commit()
    if wants_json(request):
        earlier = len(queries.label_history(session=session, model_id=found.id, layer=layer, key=key)) - 1
        body = LabelAnswer(label=pages.label_view(added), history=earlier)
        return JSONResponse(body.model_dump(mode="json"), status_code=201)
    request.state.label_author = author  # the form offers the same name next time
    response = _label_section(request, session, model, layer, key)
    remember_author(request, response, author)
    return response


@action(
    router,
    "/m/{model}/layers/{layer}/keys/{key}/labels/{label_id}/delete",
    "delete_label",
    LabelDeleted,
)
def delete_label(
    request: Request,
    session: SessionDep,
    model: str,
    layer: int,
    key: int,
    label_id: Annotated[int, Path(ge=1, le=2**31 - 1, description="The label to delete.")],
):
    """Delete a label (undo it): when it was the memory's label, the one before it is the label again."""
    found = pages.model_or_404(session, model)
    pages.check_key(found, layer, key)
    doomed = queries.get_label(session=session, label_id=label_id)
    if doomed is None or (doomed.model_id, doomed.layer, doomed.key) != (found.id, layer, key):
        raise AppError(404, "Unknown label", f"Layer {layer}, key {key} has no label {label_id}.")
    deleted = pages.label_view(doomed)
    queries.delete_label(session=session, label_id=label_id)
    session.commit()
    if wants_json(request):
        left = queries.label_history(session=session, model_id=found.id, layer=layer, key=key)
        body = LabelDeleted(
            deleted=deleted,
            label=pages.label_view(left[0]) if left else None,
            history=max(len(left) - 1, 0),
        )
        return JSONResponse(body.model_dump(mode="json"))
    return _label_section(request, session, model, layer, key)


def _label_section(request: Request, session, model: str, layer: int, key: int) -> Response:
    """After a label is saved or deleted: to htmx, the key page's label section (the page kept); to a
    plain form, the key page."""
    if wants_fragment(request):
        ctx = pages.key_page(session, model, layer, key, run_id=None, limit=1)
        return render(request, "key.html", ctx, fragment="label")
    return RedirectResponse(urls.key_url(model, layer, key), status_code=303)
