"""The live view: a prompt traced by the live worker, interventions, and one memory switched off.

Every request here is counted against the client's live budget (ffmem/web/ratelimit.py); browsing is not."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Query, Request
from pydantic import BaseModel, Field

from ffmem.web import pages
from ffmem.web import trace_view as live_view
from ffmem.web.charts import HEATMAP_MODES
from ffmem.web.contexts import AblationContext, TraceContext
from ffmem.web.errors import AppError
from ffmem.web.ratelimit import LiveBudget
from ffmem.web.rendering import render, render_error, wants_fragment, wants_json
from ffmem.web.routes import SessionDep, page, posted_page
from ffmem.web.routes.models import RunQuery

router = APIRouter()
HeatmapMode = Literal[HEATMAP_MODES]


class TraceForm(BaseModel):
    """What a trace asks for: the URL's query (GET: the URL is the share link) or a form body (POST: a
    prompt too long for a URL)."""

    text: str | None = Field(None, max_length=100_000, description="The prompt (the URL is the share link).")
    position: int | None = Field(
        None, ge=0, le=2**31 - 1, description="Token position to break down (default: the last)."
    )
    intervene: str | None = Field(
        None,
        max_length=4000,
        description="Memories to edit: L12K345 (off), L12K345*0.5 (scale), L12K345=3.2 (on).",
    )
    readout: Literal["norm", "raw"] = Field(
        "norm", description="norm: the model's final norm + unembedding; raw: r·E."
    )
    memories: int = Field(10, ge=1, le=100, description="Memories listed per layer.")
    generate: int = Field(0, ge=0, le=20, description="Greedy tokens, with and without the edits.")
    target: str | None = Field(
        None,
        max_length=10_000,
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
    refused: LiveBudget,
    model: str,
    form: Annotated[TraceForm, Query()],
):
    """Type a prompt: which memories fire, how the prediction forms layer by layer, and edits."""
    return _trace(request, session, refused, model, form)


@posted_page(router, "/m/{model}/trace", "trace_posted", TraceContext)
def trace_posted(
    request: Request,
    session: SessionDep,
    refused: LiveBudget,
    model: str,
    form: Annotated[TraceForm, Form()],
):
    """The live view of a prompt sent as a form (POST): for prompts too long for a URL."""
    if form.text is None:  # an empty form field arrives as None
        form = form.model_copy(update={"text": ""})
    return _trace(request, session, refused, model, form)


def _trace(request: Request, session, refused, model: str, form: TraceForm):
    """The trace the form asks for; on an error the form again, with the reason (JSON: the error)."""
    settings, live, f = request.app.state.settings, request.app.state.live, form
    found = pages.model_or_404(session, model)
    q = live_view.TraceQuery(
        found, f.text, f.position, f.readout, f.memories, f.generate, f.intervene, f.target
    )
    link = _link(q, settings.max_query_bytes)
    try:
        if refused:
            raise refused
        ctx = live_view.trace_page(session, live, q, settings.max_prompt_tokens)
    except AppError as error:
        if wants_json(request):
            raise
        if error.field and wants_fragment(request):
            return render_error(request, error)  # next to the field; the trace on the page stays
        # The page keeps the form and says why there is no trace (a bad prompt or edit — next to its field —,
        # too many live requests, or the worker down, busy or failed); the browse pages work on.
        notice = error.message if error.field else f"{error.title}: {error.message}"
        ctx = live_view.trace_form(live, q, settings.max_prompt_tokens, notice=notice)
        ctx = ctx.model_copy(update={"notice_field": error.field, "heatmap_mode": f.heatmap, "link": link})
        return render(request, "trace.html", ctx, "trace", status_code=error.status, headers=error.headers)
    ctx = ctx.model_copy(update={"heatmap_mode": f.heatmap, "link": link})
    return render(request, "trace.html", ctx, fragment="trace")


def _link(q: live_view.TraceQuery, max_query_bytes: int) -> str | None:
    """The trace's URL, its share link; None when its query is longer than the server accepts."""
    url = q.url()
    return url if len(url.partition("?")[2]) <= max_query_bytes else None


@page(router, "/m/{model}/layers/{layer}/keys/{key}/ablation", "ablation", AblationContext, live=True)
def ablation(
    request: Request,
    session: SessionDep,
    refused: LiveBudget,
    model: str,
    layer: int,
    key: int,
    run: RunQuery = None,
    triggers: Annotated[int, Query(ge=1, le=100, description="Top trigger prefixes to test on.")] = 10,
):
    """Switch one memory off on its own top triggers: its value's top token and the true next token."""
    if refused:
        raise refused
    ctx = live_view.ablation_page(
        session, request.app.state.live, model, layer, key, run_id=run, limit=triggers
    )
    return render(request, "ablation.html", ctx, fragment="ablation")
