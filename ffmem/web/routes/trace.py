"""The live view: a prompt traced by the live worker, interventions, and one memory switched off.

Every request here is counted against the client's live budget (ffmem/web/ratelimit.py); browsing is not."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Query, Request
from pydantic import BaseModel, Field

from ffmem.engine.live.protocol import (
    CHANGE_CONTEXTS,
    CHANGE_FACTOR,
    MAX_ABLATION_PREFIXES,
    MAX_CHANGE_CONTEXTS,
    MAX_CHANGE_FACTOR,
    MEMORIES,
    PROMPT_CHARS,
    CircuitOptions,
    Generate,
    Interventions,
    Memories,
    Readout,
    Target,
)
from ffmem.store.models import LanguageModel
from ffmem.web.deps import KeyDep, LayerDep, ModelDep, RunDep, SessionDep, SettingsDep
from ffmem.web.errors import AppError
from ffmem.web.pages.ablation import AblationContext, ablation_page, ablation_pending
from ffmem.web.pages.circuit import CircuitContext, circuit_form, circuit_page
from ffmem.web.pages.token_change import TokenChangeContext, token_change_page, token_change_pending
from ffmem.web.pages.trace import TraceContext, trace_form, trace_page
from ffmem.web.pages.trace_charts import HEATMAP_MODES
from ffmem.web.pages.trace_query import TraceQuery
from ffmem.web.ratelimit import LiveBudget, LiveResultBudget
from ffmem.web.rendering import render, render_unanswered
from ffmem.web.routes import page, posted_page
from ffmem.web.wants import wants_result

router = APIRouter()
HeatmapMode = Literal[HEATMAP_MODES]


class TraceForm(BaseModel):
    """What a trace asks for: the URL's query (GET: the URL is the share link) or a form body (POST: a
    prompt too long for a URL)."""

    text: str | None = Field(
        None, max_length=PROMPT_CHARS, description="The prompt (the URL is the share link)."
    )
    position: int | None = Field(
        None, ge=0, le=2**31 - 1, description="Token position to break down (default: the last)."
    )
    intervene: Interventions = Field(
        None, description="Memories to edit: L12K345 (off), L12K345*0.5 (scale), L12K345=3.2 (on)."
    )
    readout: Readout = Field("norm", description="norm: the model's final norm + unembedding; raw: r·E.")
    memories: Memories = MEMORIES
    generate: Generate = 0
    target: Target = Field(
        None,
        description="The token to attribute (who pushes it, here): text such as ' London' (its first "
        "token) or #id; default: the prediction.",
    )
    heatmap: HeatmapMode = Field(
        "ff_logit", description="The heatmap shown: the FF's logit change or active memories."
    )


@page(router, "/m/{model}/trace", "trace", TraceContext, live=True)
def trace(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    refused: LiveBudget,
    model: ModelDep,
    form: Annotated[TraceForm, Query()],
):
    """Type a prompt: which memories fire, how the prediction forms layer by layer, and edits."""
    return _trace(request, session, settings, refused, model, form)


@posted_page(router, "/m/{model}/trace", "trace_posted", TraceContext)
def trace_posted(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    refused: LiveBudget,
    model: ModelDep,
    form: Annotated[TraceForm, Form()],
):
    """The live view of a prompt sent as a form (POST): for prompts too long for a URL."""
    if form.text is None:  # an empty form field arrives as None
        form = form.model_copy(update={"text": ""})
    return _trace(request, session, settings, refused, model, form)


def _trace(request: Request, session, settings, refused, model: LanguageModel, form: TraceForm):
    """The trace the form asks for; on an error the form again, with the reason (JSON: the error)."""
    live, f = request.app.state.live, form
    q = TraceQuery(model, f.text, f.position, f.readout, f.memories, f.generate, f.intervene, f.target)
    shown = {"heatmap_mode": f.heatmap, "link": q.share_link(settings.max_query_bytes)}
    try:
        if refused:
            raise refused
        ctx = trace_page(session, live, q, settings.max_prompt_tokens)
    except AppError as error:

        def unanswered(notice: str, field: str | None) -> TraceContext:
            ctx = trace_form(live, q, settings.max_prompt_tokens, notice=notice)
            return ctx.model_copy(update={"notice_field": field} | shown)

        return render_unanswered(request, error, "trace.html", "trace", unanswered)
    return render(request, "trace.html", ctx.model_copy(update=shown), fragment="trace")


class CircuitForm(CircuitOptions):
    """A memory circuit: the trace's prompt, position, edits, readout and target, and how much is kept."""

    text: str | None = Field(
        None, max_length=PROMPT_CHARS, description="The prompt (the URL is the share link)."
    )
    position: int | None = Field(None, ge=0, le=2**31 - 1, description="Token position (default: the last).")
    intervene: Interventions = Field(None, description="Memories edited, as in the live view.")
    readout: Readout = Field("norm", description="norm: the model's final norm; raw: r·E.")
    target: Target = Field(None, description="The token (text or #id); default: the prediction.")


@page(router, "/m/{model}/trace/circuit", "circuit", CircuitContext, live=True)
def circuit(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    refused: LiveBudget,
    model: ModelDep,
    form: Annotated[CircuitForm, Query()],
):
    """A prompt's memory circuit: who pushes the target here, and which earlier memories fed them."""
    f = form
    q = TraceQuery(model, f.text, f.position, f.readout, 10, 0, f.intervene, f.target)
    options = CircuitOptions.model_validate(f.model_dump(include=set(CircuitOptions.model_fields)))
    try:
        if refused:
            raise refused
        ctx = circuit_page(session, request.app.state.live, q, options, settings.max_prompt_tokens)
    except AppError as error:

        def unanswered(notice: str, field: str | None) -> CircuitContext:
            return circuit_form(q, options, settings.max_prompt_tokens, notice=notice, notice_field=field)

        return render_unanswered(request, error, "circuit.html", "circuit", unanswered)
    return render(request, "circuit.html", ctx, fragment="circuit")


@page(router, "/m/{model}/layers/{layer}/keys/{key}/ablation", "ablation", AblationContext, live=True)
def ablation(
    request: Request,
    session: SessionDep,
    refused: LiveResultBudget,
    model: ModelDep,
    layer: LayerDep,
    key: KeyDep,
    run: RunDep,
    triggers: Annotated[
        int, Query(ge=1, le=MAX_ABLATION_PREFIXES, description="Top trigger prefixes to test on.")
    ] = 10,
):
    """Switch one memory off on its own top triggers: its value's top token and the true next token."""
    if not wants_result(request):  # the page at once, without the worker; htmx asks for its result
        return render(request, "ablation.html", ablation_pending(model, run, layer, key, limit=triggers))
    if refused:
        raise refused
    ctx = ablation_page(session, request.app.state.live, model, run, layer, key, limit=triggers)
    return render(request, "ablation.html", ctx, fragment="ablation")


@page(
    router, "/m/{model}/layers/{layer}/keys/{key}/token-change", "token_change", TokenChangeContext, live=True
)
def token_change(
    request: Request,
    session: SessionDep,
    refused: LiveResultBudget,
    model: ModelDep,
    layer: LayerDep,
    key: KeyDep,
    run: RunDep,
    text: Annotated[
        str | None,
        Query(max_length=PROMPT_CHARS, description="A text of your own: its top positions are the contexts."),
    ] = None,
    contexts: Annotated[
        int, Query(ge=1, le=MAX_CHANGE_CONTEXTS, description="Top trigger prefixes (or text positions).")
    ] = CHANGE_CONTEXTS,
    factor: Annotated[
        float, Query(gt=1, le=MAX_CHANGE_FACTOR, description="Amplified: m → factor·m.")
    ] = CHANGE_FACTOR,
):
    """What one memory does to the next token where its key fires (TokenChange), against its VocabProj."""
    asked = dict(text=text or None, contexts=contexts, factor=factor)
    if not wants_result(request):  # the page at once, without the worker; htmx asks for its result
        return render(request, "token_change.html", token_change_pending(model, run, layer, key, **asked))
    if refused:
        raise refused
    ctx = token_change_page(session, request.app.state.live, model, run, layer, key, **asked)
    return render(request, "token_change.html", ctx, fragment="token_change")
