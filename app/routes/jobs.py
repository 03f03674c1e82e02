"""Index jobs from the browser: start one, watch its progress, retry it when it failed."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import JSONResponse, RedirectResponse

from app import jobs, pages, urls
from app.errors import AppError
from app.models import Job
from app.rendering import render, wants_json
from app.routes import SessionDep, action, page

router = APIRouter()


@page(router, "/jobs/{job_id}", "job")
def job(request: Request, session: SessionDep, job_id: int):
    """One index job: its status, its run's progress (polled until it ends), its error."""
    return render(request, "job.html", pages.job_page(session, job_id), fragment="progress")


@action(router, "/jobs", "start_job")
def _start(
    request: Request,
    session: SessionDep,
    model: Annotated[str, Form(min_length=1, max_length=500, description="smollm2-135m, a HF id or a path.")],
    corpus: Annotated[str, Form(min_length=1, max_length=500, description="wiki-vital or a server path.")],
    sentences: Annotated[int, Form(ge=1, le=10_000_000, description="Corpus sentences to mine.")],
    top_k: Annotated[int, Form(ge=1, le=1000, description="Trigger sentences kept per key and sign.")],
):
    """Queue an index run (a worker builds it); an identical unfinished one is reused."""
    settings = request.app.state.settings
    options = jobs.run_options(
        settings, model=model.strip(), corpus=corpus.strip(), sentences=sentences, top_k=top_k
    )
    queued, _ = jobs.enqueue(session=session, options=options)
    session.commit()
    if wants_json(request):
        ctx = pages.job_page(session, queued.id)
        return JSONResponse(ctx.model_dump(mode="json"), status_code=201)
    return RedirectResponse(urls.job_url(queued.id), status_code=303)


@action(router, "/jobs/{job_id}/retry", "retry_job")
def _retry(request: Request, session: SessionDep, job_id: int):
    """Queue a failed job again; its run resumes from its checkpoints."""
    found = session.get(Job, job_id)
    if found is None:
        raise AppError(404, "Unknown job", f"There is no job {job_id}.")
    if found.status != "failed":
        raise AppError(
            409, "Not failed", f"Job {job_id} is {found.status}; only a failed job can be retried."
        )
    jobs.retry(session=session, job_id=job_id)
    session.commit()
    if wants_json(request):
        return JSONResponse(pages.job_page(session, job_id).model_dump(mode="json"))
    return RedirectResponse(urls.job_url(job_id), status_code=303)
