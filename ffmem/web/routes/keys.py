"""The key page: trigger prefixes, the value's tokens, the histogram and key–value agreement."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Path, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, Field

from ffmem.config import Settings
from ffmem.engine.live.protocol import PROMPT_CHARS
from ffmem.store import memory_labels, vocabularies
from ffmem.store.models import LanguageModel, Run
from ffmem.web import urls
from ffmem.web.access import admin_name, remember_author
from ffmem.web.deps import KeyDep, LayerDep, ModelDep, RunDep, SessionDep, SettingsDep
from ffmem.web.errors import AppError
from ffmem.web.lookups import run_or_404
from ffmem.web.pages import try_text
from ffmem.web.pages.key import KeyContext, key_page
from ffmem.web.pages.labels import LabelAnswer, LabelDeleted
from ffmem.web.pages.quadrants import QuadrantContext, quadrant_page
from ffmem.web.pages.related import RelatedContext, related_page
from ffmem.web.pages.samples import SamplesContext, samples_page
from ffmem.web.ratelimit import LiveBudget, LiveTextBudget
from ffmem.web.rendering import render, render_unanswered
from ffmem.web.routes import action, page, posted_page
from ffmem.web.views import label_view
from ffmem.web.wants import wants_fragment, wants_json

router = APIRouter()


TriggersQuery = Annotated[int, Query(ge=1, le=1000, description="Trigger prefixes shown per sign.")]


class TryTextForm(BaseModel):
    """The key page's "try your own text": the URL's query (GET) or a form body (POST: a text too long for a
    URL)."""

    text: str | None = Field(
        None,
        max_length=PROMPT_CHARS,
        description="Try your own text: this key's coefficient at every token (asks the live worker).",
    )


@page(router, "/m/{model}/layers/{layer}/keys/{key}", "key", KeyContext, live=True)
def key(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    refused: LiveTextBudget,
    model: ModelDep,
    layer: LayerDep,
    key: KeyDep,
    run: RunDep,
    triggers: TriggersQuery = 25,
    *,
    form: Annotated[TryTextForm, Query()],
):
    """One memory: its key's trigger prefixes and its value's vocabulary distribution."""
    return _key_page(request, session, settings, refused, model, run, (layer, key), triggers, form.text)


@posted_page(router, "/m/{model}/layers/{layer}/keys/{key}", "key_posted", KeyContext)
def key_posted(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    refused: LiveBudget,
    model: ModelDep,
    layer: LayerDep,
    key: KeyDep,
    run: RunDep,
    triggers: TriggersQuery = 25,
    *,
    form: Annotated[TryTextForm, Form()],
):
    """A key page with "try your own text" sent as a form (POST): for texts too long for a URL."""
    text = form.text or ""  # an empty form field arrives as None
    return _key_page(request, session, settings, refused, model, run, (layer, key), triggers, text)


def _key_page(
    request: Request,
    session,
    settings: Settings,
    refused,
    model: LanguageModel,
    run: Run,
    memory: tuple[int, int],
    triggers: int,
    text: str | None,
):
    """The key page; with a text, this key's coefficient at every token of it (or why there is none)."""
    max_tokens = settings.max_prompt_tokens
    ctx = key_page(session, model, run, *memory, limit=triggers)
    fragment = "try_text" if request.headers.get("HX-Target") == "try_text" else "triggers"
    if text is None:
        return render(request, "key.html", _tried(ctx, try_text.form(None, max_tokens)), fragment=fragment)
    try:
        if refused:
            raise refused
        extremes = (ctx.stats.max_coefficient, ctx.stats.min_coefficient) if ctx.stats else ()
        tried = try_text.answer(
            session, request.app.state.live, model, run, memory, extremes, text, max_tokens
        )
    except AppError as error:

        def unanswered(notice: str, field: str | None) -> KeyContext:
            return _tried(ctx, try_text.form(text, max_tokens, notice=notice, field=field))

        return render_unanswered(request, error, "key.html", fragment, unanswered)
    return render(request, "key.html", _tried(ctx, tried), fragment=fragment)


@page(router, "/m/{model}/layers/{layer}/keys/{key}/samples", "key_samples", SamplesContext)
def samples(
    request: Request, session: SessionDep, model: ModelDep, layer: LayerDep, key: KeyDep, run: RunDep
):
    """One memory's examples across its coefficient range: a few sentences from each band of its histogram."""
    ctx = samples_page(session, model, run, layer, key)
    return render(request, "samples.html", ctx, fragment="samples")


@page(router, "/m/{model}/layers/{layer}/keys/{key}/quadrants/{quadrant}", "key_quadrant", QuadrantContext)
def quadrant(
    request: Request,
    session: SessionDep,
    model: ModelDep,
    layer: LayerDep,
    key: KeyDep,
    run: RunDep,
    quadrant: Annotated[
        Literal["pp", "pn", "np", "nn"],
        Path(description="The gate's sign, then the input's (p: ≥ 0, n: < 0)."),
    ],
):
    """A gated memory's top examples in one sign quadrant of gate act(x·g) and input x·u."""
    ctx = quadrant_page(session, model, run, layer, key, quadrant)
    return render(request, "quadrant.html", ctx)


@page(router, "/m/{model}/layers/{layer}/keys/{key}/related", "key_related", RelatedContext)
def related(
    request: Request, session: SessionDep, model: ModelDep, layer: LayerDep, key: KeyDep, run: RunDep
):
    """The memories related to one: nearest by key and value direction, and who feeds it and whom it feeds."""
    ctx = related_page(session, model, run, layer, key)
    return render(request, "related.html", ctx, fragment="related")


def _tried(ctx: KeyContext, tried) -> KeyContext:
    return ctx.model_copy(update={"try_text": tried})


@action(router, "/m/{model}/layers/{layer}/keys/{key}/labels", "label_key", LabelAnswer, status=201)
def label(
    request: Request,
    session: SessionDep,
    model: ModelDep,
    layer: LayerDep,
    key: KeyDep,
    pattern: Annotated[str, Form(max_length=500, description="What the trigger prefixes share.")] = "",
    tag: Annotated[Literal["shallow", "semantic", ""], Form(description="shallow, semantic or none.")] = "",
    author: Annotated[
        str, Form(max_length=100, description="Who labels it (default: the name given at /login).")
    ] = "",
):
    """Label a memory (a pattern description and a shallow/semantic tag); earlier labels stay as history."""
    pattern, author = pattern.strip(), author.strip() or admin_name(request) or ""
    if not pattern and not tag:
        raise AppError(
            400,
            "Empty label",
            "Give a pattern description, a tag (shallow or semantic), or both.",
            field="pattern",
        )
    added = memory_labels.add_label(
        session=session,
        model_id=model.id,
        layer=layer,
        key=key,
        pattern=vocabularies.stored_text(pattern),
        tag=tag,
        author=vocabularies.stored_text(author),
    )
    session.commit()
    if wants_json(request):
        earlier = (
            len(memory_labels.label_history(session=session, model_id=model.id, layer=layer, key=key)) - 1
        )
        body = LabelAnswer(label=label_view(added), history=earlier)
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
    model: ModelDep,
    layer: LayerDep,
    key: KeyDep,
    label_id: Annotated[int, Path(ge=1, le=2**31 - 1, description="The label to delete.")],
):
    """Delete a label (undo it): when it was the memory's label, the one before it is the label again."""
    doomed = memory_labels.get_label(session=session, label_id=label_id)
    if doomed is None or (doomed.model_id, doomed.layer, doomed.key) != (model.id, layer, key):
        raise AppError(404, "Unknown label", f"Layer {layer}, key {key} has no label {label_id}.")
    deleted = label_view(doomed)
    memory_labels.delete_label(session=session, label_id=label_id)
    session.commit()
    if wants_json(request):
        left = memory_labels.label_history(session=session, model_id=model.id, layer=layer, key=key)
        body = LabelDeleted(
            deleted=deleted,
            label=label_view(left[0]) if left else None,
            history=max(len(left) - 1, 0),
        )
        return JSONResponse(body.model_dump(mode="json"))
    return _label_section(request, session, model, layer, key)


def _label_section(request: Request, session, model: LanguageModel, layer: int, key: int) -> Response:
    """After a label is saved or deleted: to htmx, the key page's label section (the page kept), in the
    newest run; to a plain form, the key page."""
    if wants_fragment(request):
        ctx = key_page(session, model, run_or_404(session, model, None), layer, key, limit=1)
        return render(request, "key.html", ctx, fragment="label")
    return RedirectResponse(urls.key_url(model.slug, layer, key), status_code=303)
