"""Home (models and their runs), the model page (statistics across layers) and its analyses."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Form, Path, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from ffmem.store import jobs, runs
from ffmem.store.models import RunStatus
from ffmem.store.specs import AnalysisSpec
from ffmem.web import urls
from ffmem.web.deps import ModelDep, RunDep, SessionDep, SettingsDep
from ffmem.web.errors import AppError
from ffmem.web.lookups import run_or_404
from ffmem.web.pages import corpora
from ffmem.web.pages.analysis import AnalysisContext, analysis_page
from ffmem.web.pages.home import HomeContext, home_page
from ffmem.web.pages.jobs import JobContext, job_page
from ffmem.web.pages.labels import LabelsContext, LabelSort, labels_csv, labels_page
from ffmem.web.pages.model import ModelContext, model_page
from ffmem.web.rendering import render
from ffmem.web.routes import ERRORS, _errors, action, page
from ffmem.web.wants import wants_json

router = APIRouter()


@page(router, "/", "home", HomeContext)
def home(request: Request, session: SessionDep, settings: SettingsDep):
    """The indexed models and their index runs."""
    offered = corpora.choices(settings.upload_folder)
    return render(request, "home.html", home_page(session, offered))


@page(router, "/m/{model}", "model", ModelContext)
def model(request: Request, session: SessionDep, model: ModelDep, run: RunDep):
    """One model: statistics per layer, and charts across layers."""
    return render(request, "model.html", model_page(session, model, run))


LabelSortQuery = Annotated[
    LabelSort, Query(description="key: by layer, then key; label: by the label's text; date: newest first.")
]


@page(router, "/m/{model}/labels", "labels", LabelsContext)
def labels(request: Request, session: SessionDep, model: ModelDep, sort: LabelSortQuery = "key"):
    """Every labelled memory of a model with its current label, sortable; as CSV at labels.csv."""
    return render(request, "labels.html", labels_page(session, model, sort))


@router.get(
    "/m/{model}/labels.csv",
    name="labels_csv",
    summary="Every labelled memory of a model with its current label, as CSV",
    response_class=Response,
    responses={200: {"content": {"text/csv": {"schema": {"type": "string"}}}}} | _errors(ERRORS, "html"),
)
def labels_as_csv(session: SessionDep, model: ModelDep, sort: LabelSortQuery = "key"):
    """The labels index as CSV: layer, key, pattern, tag, author, created_at (UTC), url."""
    ctx = labels_page(session, model, sort)
    filename = f"{ctx.model}-labels.csv"
    return Response(
        labels_csv(ctx),
        media_type="text/csv; charset=utf-8",
        headers={"Content-Disposition": f"attachment; filename*=UTF-8''{quote(filename, safe='')}"},
    )


@page(router, "/m/{model}/analysis", "analysis", AnalysisContext)
def analysis(request: Request, session: SessionDep, settings: SettingsDep, model: ModelDep, run: RunDep):
    """The paper's analyses (Figs. 3–11) on an index run, beside the paper's own values."""
    return render(request, "analysis.html", analysis_page(session, settings, model, run))


@action(router, "/m/{model}/analysis", "start_analysis", JobContext, status=201)
def _start_analysis(
    request: Request,
    session: SessionDep,
    model: ModelDep,
    run: Annotated[int, Form(ge=1, le=2**31 - 1, description="The index run to analyze.")],
    examples: Annotated[int, Form(ge=1, le=1_000_000, description="Held-out prefixes (Figs. 7–11).")],
    keys: Annotated[int, Form(ge=1, le=1_000_000, description="Keys sampled per layer (Fig. 3).")],
    triggers: Annotated[int, Form(ge=1, le=1000, description="Top triggers per sampled key (Fig. 3).")],
):
    """Queue the paper's analyses of an index run (a worker computes them); an identical one is reused."""
    found = run_or_404(session, model, run)  # a form's run: checked as `?run=` is (RunDep)
    spec = AnalysisSpec.from_settings(
        request.app.state.settings, examples=examples, keys=keys, triggers=triggers
    )
    queued, _ = jobs.enqueue_analysis(session=session, spec=spec, run_id=found.id)
    session.commit()
    if wants_json(request):
        return JSONResponse(job_page(session, queued).model_dump(mode="json"), status_code=201)
    return RedirectResponse(urls.job_url(queued.id), status_code=303)


@action(router, "/m/{model}/runs/{run}/delete", "delete_run", HomeContext)
def _delete_run(
    request: Request,
    session: SessionDep,
    model: ModelDep,
    run: Annotated[int, Path(ge=1, le=2**31 - 1, description="The index run to delete.")],
):
    """Delete an index run: its triggers, statistics, value tokens, analyses and jobs (not its labels)."""
    doomed = runs.get_run(session=session, run_id=run)
    if doomed is None or doomed.model_id != model.id:
        raise AppError(404, "Unknown run", f"Model {model.slug!r} has no run {run}.")
    if doomed.status == RunStatus.running:
        raise AppError(
            409, "Run being built", f"Run {run} is being built; delete it once it is done or failed."
        )
    runs.delete_run(session=session, run_id=run)
    session.commit()
    if wants_json(request):
        return JSONResponse(home_page(session).model_dump(mode="json"))
    return RedirectResponse(urls.home_url(), status_code=303)
