"""The key page: trigger prefixes, the value's tokens, the histogram and key–value agreement."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Path, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from ffmem.store import queries
from ffmem.web import pages, try_text, urls
from ffmem.web.access import admin_name, remember_author
from ffmem.web.contexts import KeyContext, LabelAnswer, LabelDeleted, RelatedContext, SamplesContext
from ffmem.web.errors import AppError
from ffmem.web.ratelimit import LiveBudget, LiveTextBudget
from ffmem.web.rendering import render, render_error, wants_fragment, wants_json
from ffmem.web.routes import SessionDep, action, page, posted_page
from ffmem.web.routes.models import RunQuery

router = APIRouter()


TriggersQuery = Annotated[int, Query(ge=1, le=1000, description="Trigger prefixes shown per sign.")]


@page(router, "/m/{model}/layers/{layer}/keys/{key}", "key", KeyContext, live=True)
def key(
    request: Request,
    session: SessionDep,
    refused: LiveTextBudget,
    model: str,
    layer: int,
    key: int,
    run: RunQuery = None,
    triggers: TriggersQuery = 25,
    text: Annotated[
        str | None,
        Query(
            max_length=100_000,
            description="Try your own text: this key's coefficient at every token (asks the live worker).",
        ),
    ] = None,
):
    """One memory: its key's trigger prefixes and its value's vocabulary distribution."""
    return _key_page(request, session, refused, model, layer, key, run, triggers, text)


@posted_page(router, "/m/{model}/layers/{layer}/keys/{key}", "key_posted", KeyContext)
def key_posted(
    request: Request,
    session: SessionDep,
    refused: LiveBudget,
    model: str,
    layer: int,
    key: int,
    run: RunQuery = None,
    triggers: TriggersQuery = 25,
    text: Annotated[
        str | None,
        Form(max_length=100_000, description="The text to try: this key's coefficient at every token."),
    ] = None,
):
    """A key page with "try your own text" sent as a form (POST): for texts too long for a URL."""
    return _key_page(request, session, refused, model, layer, key, run, triggers, text or "")


def _key_page(request: Request, session, refused, model, layer, key, run, triggers, text: str | None):
    """The key page; with a text, this key's coefficient at every token of it (or why there is none)."""
    ctx = pages.key_page(session, model, layer, key, run_id=run, limit=triggers)
    max_tokens = request.app.state.settings.max_prompt_tokens
    fragment = "try_text" if request.headers.get("HX-Target") == "try_text" else "triggers"
    if text is None:
        return render(request, "key.html", _tried(ctx, try_text.form(None, max_tokens)), fragment=fragment)
    try:
        if refused:
            raise refused
        tried = try_text.answer(session, request.app.state.live, ctx, text, max_tokens)
    except AppError as error:
        if wants_json(request):
            raise
        if error.field and wants_fragment(request):
            return render_error(request, error)  # next to the box; the answer on the page stays
        # The page (or the section, to htmx) keeps the box and says why there is no answer: a bad text
        # next to the box; too many live requests, or the worker down, busy or failed, in a notice.
        notice = error.message if error.field else f"{error.title}: {error.message}"
        ctx = _tried(ctx, try_text.form(text, max_tokens, notice=notice, field=error.field))
        return render(request, "key.html", ctx, fragment, status_code=error.status, headers=error.headers)
    return render(request, "key.html", _tried(ctx, tried), fragment=fragment)


@page(router, "/m/{model}/layers/{layer}/keys/{key}/samples", "key_samples", SamplesContext)
def samples(request: Request, session: SessionDep, model: str, layer: int, key: int, run: RunQuery = None):
    """One memory's examples across its coefficient range: a few sentences from each band of its histogram."""
    ctx = pages.samples_page(session, model, layer, key, run_id=run)
    return render(request, "samples.html", ctx, fragment="samples")


@page(router, "/m/{model}/layers/{layer}/keys/{key}/related", "key_related", RelatedContext)
def related(request: Request, session: SessionDep, model: str, layer: int, key: int, run: RunQuery = None):
    """The memories related to one: nearest by key and value direction, and who feeds it and whom it feeds."""
    ctx = pages.related_page(session, model, layer, key, run_id=run)
    return render(request, "related.html", ctx, fragment="related")


def _tried(ctx: KeyContext, tried) -> KeyContext:
    return ctx.model_copy(update={"try_text": tried})


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
