"""The explorer's lookups: a model by slug, an index run, a layer and a key, each checked to exist. A
person who asked for something that does not exist gets an AppError with the valid range or the known
names; a model or run whose index is being built, a 503 that says how far it is (Retry-After, a link to its
job). Routes receive them resolved, as dependencies (ffmem/web/deps.py).
"""

from __future__ import annotations

from sqlalchemy.orm import Session, object_session

from ffmem.engine.model.model_names import slugify
from ffmem.store import jobs, runs, shards
from ffmem.store.models import Job, JobStatus, LanguageModel, Run, RunStatus
from ffmem.store.results import has_results
from ffmem.web import urls
from ffmem.web.display import percent
from ffmem.web.errors import AppError

BUILDING_RETRY = 10  # seconds a client waits before asking again for a model whose index is being built


def model_or_404(session: Session, slug: str) -> LanguageModel:
    """The model of this slug; else a 503 while a job prepares its first index, or a 404 naming the known."""
    model = runs.get_model(session=session, slug=slug)
    if model is None:
        for job in jobs.preparing(session=session):
            if slugify(job.spec.model) == slug:
                raise being_built(job, f"Job {job.id} is preparing the index of {slug!r}")
        known = [m.slug for m in runs.list_models(session=session)]
        listed = ", ".join(known) if known else "none yet (build one with `ffmem index`)"
        raise AppError(404, "Unknown model", f"There is no model {slug!r}. Known models: {listed}.")
    return model


def being_built(job: Job, what: str) -> AppError:
    """A 503 for a page whose index job `job` has not stored what it shows yet: what it is doing, how far
    it is, and a link to its page."""
    if job.status == JobStatus.queued:
        doing = "queued, waiting for a worker"
    elif job.run is None:
        doing = "loading the model, reading the corpus and projecting the values"
    else:
        mined = shards.progress(session=object_session(job), run=job.run).fraction
        doing = f"{percent(mined)} of the corpus mined; pages show its results from the first checkpoint"
    message = f"{what} ({doing}). Its progress: {urls.job_url(job.id)}"
    headers = {"Retry-After": str(BUILDING_RETRY)}
    return AppError(503, "Index being built", message, headers, link=(urls.job_url(job.id), f"job {job.id}"))


def run_or_404(session: Session, model: LanguageModel, run_id: int | None) -> Run:
    """The pinned run (`?run=`), or the model's newest finished one, or else the run being built
    (provisional results) once it has mined something."""
    if run_id is None:
        run = runs.latest_finished_run(session=session, model_id=model.id)
        if run is None:
            building = jobs.building(session=session, model_id=model.id)
            if building is not None and has_results(session, building.run):
                return building.run
            if building is not None:
                raise being_built(
                    building, f"Job {building.id} is building the first index of {model.slug!r}"
                )
            raise AppError(404, "No finished index", f"Model {model.slug!r} has no finished index run yet.")
        return run
    run = runs.get_run(session=session, run_id=run_id)
    if run is None or run.model_id != model.id:
        known = ", ".join(str(r.id) for r in model.runs) or "none"
        raise AppError(404, "Unknown run", f"Model {model.slug!r} has no run {run_id}. Its runs: {known}.")
    if run.status == RunStatus.failed:
        raise AppError(404, "Run failed", f"Run {run_id} failed; its results are not stored.")
    if not has_results(session, run):
        raise AppError(404, "Run not started", f"Run {run_id} has mined nothing yet.")
    return run


def check_layer(model: LanguageModel, layer: int) -> None:
    """404 unless the model has layer `layer`."""
    if not 0 <= layer < model.n_layers:
        raise AppError(
            404,
            "Layer not found",
            f"{model.slug} has layers 0–{model.n_layers - 1}; there is no layer {layer}.",
        )


def check_key(model: LanguageModel, layer: int, key: int) -> None:
    """404 unless the model has layer `layer` and key `key`."""
    check_layer(model, layer)
    if not 0 <= key < model.n_keys:
        raise AppError(
            404, "Key not found", f"Layer {layer} has keys 0–{model.n_keys - 1}; there is no key {key}."
        )
