"""Jobs from the browser: start an index run (and its analyses), watch a job's progress, retry it when
it failed."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from sqlalchemy.orm import Session

from ffmem.config import Settings
from ffmem.engine.mining.text_files import CorpusError, corpus_file
from ffmem.store import jobs
from ffmem.store.models import JobStatus
from ffmem.store.specs import AnalysisSpec, RunSpec
from ffmem.web import urls
from ffmem.web.deps import JobDep, SessionDep, SettingsDep
from ffmem.web.errors import AppError, sentence
from ffmem.web.pages import corpora
from ffmem.web.pages.home import home_page
from ffmem.web.pages.jobs import JobContext, JobsContext, job_page, jobs_page
from ffmem.web.rendering import render
from ffmem.web.routes import action, page
from ffmem.web.wants import wants_json

router = APIRouter()


@page(router, "/jobs", "jobs", JobsContext)
def jobs_list(
    request: Request,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000, description="Jobs listed, the newest first.")] = 100,
):
    """Every job, the newest first: what it computes, its status, when it ran."""
    return render(request, "jobs.html", jobs_page(session, limit=limit))


@page(router, "/jobs/{job_id}", "job", JobContext)
def job(request: Request, session: SessionDep, settings: SettingsDep, found: JobDep):
    """One job: its status, its progress (polled until it ends), its error."""
    local = request.app.state.local_worker
    ctx = job_page(session, found, max_attempts=settings.max_attempts, local_worker=local)
    return render(request, "job.html", ctx, fragment="progress")


@action(router, "/jobs", "start_job", JobContext, status=201)
def _start(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    model: Annotated[str, Form(min_length=1, max_length=500, description="smollm2-135m, a HF id or a path.")],
    corpus: Annotated[str, Form(min_length=1, max_length=500, description="wiki-vital or a server path.")],
    top_k: Annotated[int, Form(ge=1, le=1000, description="Trigger sentences kept per key and sign.")],
    sentences: Annotated[
        int | None, Form(ge=1, le=10_000_000, description="Corpus sentences to read (empty: all of them).")
    ] = None,
    analyze: Annotated[
        bool, Form(description="Then compute the paper's analyses of the run (the settings' sizes).")
    ] = False,
    first_position: Annotated[
        bool | None,
        Form(description="Also mine a sentence's first token where no BOS precedes it (default: setting)."),
    ] = None,
):
    """Queue an index run (a worker builds it); an identical unfinished one is reused. A refused model or
    corpus: the home page again, the message next to the field and the typed values kept (JSON: the error)."""
    model, corpus = model.strip(), corpus.strip()
    try:
        _check_fields(model, corpus)
    except AppError as error:
        if wants_json(request):
            raise
        typed = dict(model=model, corpus=corpus, sentences="" if sentences is None else str(sentences))
        typed |= dict(top_k=str(top_k), analyze=analyze, first_position=first_position)
        return _refused_form(request, session, settings, error, typed)
    spec = RunSpec.from_settings(
        settings, model=model, corpus=corpus, sentences=sentences, top_k=top_k, first_position=first_position
    )
    analysis = AnalysisSpec.from_settings(settings) if analyze else None
    queued, _, _ = jobs.enqueue_run(session=session, spec=spec, analysis=analysis)
    session.commit()
    if wants_json(request):
        ctx = job_page(session, queued, local_worker=request.app.state.local_worker)
        return JSONResponse(ctx.model_dump(mode="json"), status_code=201)
    return RedirectResponse(urls.job_url(queued.id), status_code=303)


@action(router, "/jobs/{job_id}/retry", "retry_job", JobContext)
def _retry(request: Request, session: SessionDep, found: JobDep):
    """Queue a failed job again; its run resumes from its checkpoints."""
    if found.status != JobStatus.failed:
        raise AppError(
            409, "Not failed", f"Job {found.id} is {found.status}; only a failed job can be retried."
        )
    queued = jobs.retry(session=session, job_id=found.id)  # or the unfinished job with its options
    session.commit()
    if wants_json(request):
        ctx = job_page(session, queued, local_worker=request.app.state.local_worker)
        return JSONResponse(ctx.model_dump(mode="json"))
    return RedirectResponse(urls.job_url(queued.id), status_code=303)


def _refused_form(
    request: Request, session: Session, settings: Settings, error: AppError, typed: dict
) -> Response:
    """The home page again with the index form as it was sent (`typed`), `error` next to its field."""
    ctx = home_page(session, corpora.choices(settings.upload_folder))
    errors = {error.field: error.message}
    return render(request, "home.html", ctx, status_code=error.status, field_errors=errors, form=typed)


def _check_fields(model: str, corpus: str) -> None:
    """A blank model or corpus is a 400; a corpus path is checked now, before a job is queued: a missing
    path, a folder, an empty or a binary file is a 400 that says so. Each error names its field. The
    workers read the same path (run them where this server's corpus files are, or on a shared folder); one
    that cannot read it still fails its job with the reason."""
    for name, given in (("model", model), ("corpus", corpus)):
        if not given:
            raise AppError(400, "Bad request", f"{name}: must not be blank", field=name)
    if corpus == "wiki-vital":
        return
    try:
        corpus_file(corpus)
    except CorpusError as error:
        raise AppError(400, "Unusable corpus", sentence(str(error)), field="corpus") from None
