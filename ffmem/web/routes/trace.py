"""The live view: a prompt traced by the live worker, interventions, and one memory switched off.

Every request here is counted against the client's live budget (ffmem/web/ratelimit.py); browsing is not."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request

from ffmem.web import pages
from ffmem.web import trace_view as live_view
from ffmem.web.charts import HEATMAP_MODES
from ffmem.web.contexts import AblationContext, TraceContext
from ffmem.web.errors import AppError
from ffmem.web.ratelimit import LiveBudget
from ffmem.web.rendering import render, render_error, wants_fragment, wants_json
from ffmem.web.routes import SessionDep, page
from ffmem.web.routes.models import RunQuery

router = APIRouter()
HeatmapMode = Literal[HEATMAP_MODES]


@page(router, "/m/{model}/trace", "trace", TraceContext, live=True)
def trace(
    request: Request,
    session: SessionDep,
    refused: LiveBudget,
    model: str,
    text: Annotated[
        str | None, Query(max_length=100_000, description="The prompt (the URL is the share link).")
    ] = None,
    position: Annotated[
        int | None, Query(ge=0, le=2**31 - 1, description="Token position to break down (default: the last).")
    ] = None,
    intervene: Annotated[
        str | None,
        Query(
            max_length=4000,
            description="Memories to edit: L12K345 (off), L12K345*0.5 (scale), L12K345=3.2 (on).",
        ),
    ] = None,
    readout: Annotated[
        Literal["norm", "raw"], Query(description="norm: the model's final norm + unembedding; raw: r·E.")
    ] = "norm",
    memories: Annotated[int, Query(ge=1, le=100, description="Memories listed per layer.")] = 10,
    generate: Annotated[
        int, Query(ge=0, le=20, description="Greedy tokens, with and without the edits.")
    ] = 0,
    target: Annotated[
        str | None,
        Query(
            max_length=10_000,
            description="The token to attribute (who pushes it, here): text such as ' London' (its first "
            "token) or #id; default: the prediction.",
        ),
    ] = None,
    heatmap: Annotated[
        HeatmapMode, Query(description="The heatmap shown: the FF's logit change or active memories.")
    ] = "ff_logit",
):
    """Type a prompt: which memories fire, how the prediction forms layer by layer, and edits."""
    settings = request.app.state.settings
    live = request.app.state.live
    q = live_view.TraceQuery(
        pages.model_or_404(session, model), text, position, readout, memories, generate, intervene, target
    )
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
        ctx = ctx.model_copy(update={"notice_field": error.field, "heatmap_mode": heatmap})
        return render(request, "trace.html", ctx, "trace", status_code=error.status, headers=error.headers)
    ctx = ctx.model_copy(update={"heatmap_mode": heatmap})
    return render(request, "trace.html", ctx, fragment="trace")


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
