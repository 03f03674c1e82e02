"""Home (models and their runs), the model page (statistics across layers) and its analyses."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Form, Path, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from ffmem.store import jobs, queries
from ffmem.web import analysis_page, corpora, labels_page, pages, urls
from ffmem.web.contexts import AnalysisContext, HomeContext, JobContext, ModelContext
from ffmem.web.errors import AppError
from ffmem.web.labels_page import LabelsContext, LabelSort
from ffmem.web.rendering import render, wants_json
from ffmem.web.routes import ERRORS, SessionDep, _errors, action, page

router = APIRouter()
RunQuery = Annotated[
    int | None, Query(ge=1, le=2**31 - 1, description="Pin an index run (default: the newest finished one).")
]


@page(router, "/", "home", HomeContext)
def home(request: Request, session: SessionDep):
    """The indexed models and their index runs."""
    offered = corpora.choices(request.app.state.settings.upload_dir)
    return render(request, "home.html", pages.home_page(session, corpora=offered))


@page(router, "/m/{model}", "model", ModelContext)
def model(request: Request, session: SessionDep, model: str, run: RunQuery = None):
    """One model: statistics per layer, and charts across layers."""
    return render(request, "model.html", pages.model_page(session, model, run))


LabelSortQuery = Annotated[
    LabelSort, Query(description="key: by layer, then key; label: by the label's text; date: newest first.")
]


@page(router, "/m/{model}/labels", "labels", LabelsContext)
def labels(request: Request, session: SessionDep, model: str, sort: LabelSortQuery = "key"):
    """Every labelled memory of a model with its current label, sortable; as CSV at labels.csv."""
    return render(request, "labels.html", labels_page.labels_page(session, model, sort))


@router.get(
    "/m/{model}/labels.csv",
    name="labels_csv",
    summary="Every labelled memory of a model with its current label, as CSV",
    response_class=Response,
    responses={200: {"content": {"text/csv": {"schema": {"type": "string"}}}}} | _errors(ERRORS, "html"),
)
def labels_csv(session: SessionDep, model: str, sort: LabelSortQuery = "key"):
    """The labels index as CSV: layer, key, pattern, tag, author, created_at (UTC), url."""
    ctx = labels_page.labels_page(session, model, sort)
    filename = f"{ctx.model}-labels.csv"
    return Response(
        labels_page.labels_csv(ctx),
        media_type="text/csv; charset=utf-8",
        headers={"Content-Disposition": f"attachment; filename*=UTF-8''{quote(filename, safe='')}"},
    )


@page(router, "/m/{model}/analysis", "analysis", AnalysisContext)
def analysis(request: Request, session: SessionDep, model: str, run: RunQuery = None):
    """The paper's analyses (Figs. 3–11) on an index run, beside the paper's own values."""
    settings = request.app.state.settings
    return render(request, "analysis.html", analysis_page.analysis_page(session, settings, model, run))


@action(router, "/m/{model}/analysis", "start_analysis", JobContext, status=201)
def _start_analysis(
    request: Request,
    session: SessionDep,
    model: str,
    run: Annotated[int, Form(ge=1, le=2**31 - 1, description="The index run to analyze.")],
    examples: Annotated[int, Form(ge=1, le=1_000_000, description="Held-out prefixes (Figs. 7–11).")],
    keys: Annotated[int, Form(ge=1, le=1_000_000, description="Keys sampled per layer (Fig. 3).")],
    triggers: Annotated[int, Form(ge=1, le=1000, description="Top triggers per sampled key (Fig. 3).")],
):
    """Queue the paper's analyses of an index run (a worker computes them); an identical one is reused."""
    found = pages.run_or_404(session, pages.model_or_404(session, model), run)
    options = jobs.analysis_options(
        request.app.state.settings, examples=examples, keys=keys, triggers=triggers
    )
    queued, _ = jobs.enqueue_analysis(session=session, options=options, run_id=found.id)
    session.commit()
    if wants_json(request):
        return JSONResponse(pages.job_page(session, queued.id).model_dump(mode="json"), status_code=201)
    return RedirectResponse(urls.job_url(queued.id), status_code=303)


@action(router, "/m/{model}/runs/{run}/delete", "delete_run", HomeContext)
def _delete_run(
    request: Request,
    session: SessionDep,
    model: str,
    run: Annotated[int, Path(ge=1, le=2**31 - 1, description="The index run to delete.")],
):
    """Delete an index run: its triggers, statistics, value tokens, analyses and jobs (not its labels)."""
    found = pages.model_or_404(session, model)
    doomed = queries.get_run(session=session, run_id=run)
    if doomed is None or doomed.model_id != found.id:
        raise AppError(404, "Unknown run", f"Model {found.slug!r} has no run {run}.")
    if doomed.status == "running":
        raise AppError(
            409, "Run being built", f"Run {run} is being built; delete it once it is done or failed."
        )
    queries.delete_run(session=session, run_id=run)
    session.commit()
    if wants_json(request):
        return JSONResponse(pages.home_page(session).model_dump(mode="json"))
    return RedirectResponse(urls.home_url(), status_code=303)
