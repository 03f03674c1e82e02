"""The jobs pages: every job, the newest first; and one job, its progress polled until it ends."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ffmem.store import analyses, jobs
from ffmem.store.db import Session
from ffmem.store.models import Job, JobKind
from ffmem.store.progress import run_progress
from ffmem.web.views import JobInfo, RunInfo, run_info


class Progress(BaseModel):
    """How far a run's mining has come, over all its shards."""

    sentences_done: int
    n_sentences: int
    fraction: float = Field(description="The share of the corpus mined, 0–1.")
    tokens_done: int
    shards: int = Field(description="The run's corpus shards (workers claim one at a time).")
    shards_done: int
    tokens_per_s: float | None = Field(description="Tokens mined per second so far (null once done).")
    eta_seconds: float | None = Field(description="Seconds left at that rate (null once done).")


class ExplainerReport(BaseModel):
    """How the local explainer (explainer_url) did in the run's explanations step."""

    sides: int = Field(description="Sides of memories (m > 0, m < 0) it was asked to describe.")
    failures: int = Field(
        description="Sides it failed on (an error, a timeout, no usable answer): they keep the token-table "
        "descriptions."
    )
    gave_up: bool = Field(description="Whether it stopped asking after failures in a row.")
    simulated: int = Field(0, description="Sides it simulated for the simulation score.")
    simulation_failures: int = 0


class JobContext(BaseModel):
    """One job: its status, its run and progress, its error."""

    page: str = "job"
    title: str
    job: JobInfo
    run: RunInfo | None
    model: str | None = Field(description="The run's model slug, once known.")
    progress: Progress | None = Field(description="An index job's mining, once its run is stored.")
    polling: bool = Field(description="The page refreshes its progress until the job ends.")
    max_attempts: int | None = Field(
        None, description="Times a worker may take up one step (Settings.max_attempts)."
    )
    local_worker: bool = Field(
        False, description="This server started its own worker (`ffmem serve`): it takes queued jobs."
    )
    explainer: ExplainerReport | None = Field(
        None, description="The local explainer's part in the run's explanations, where one was set."
    )


class JobsContext(BaseModel):
    """Every job, the newest first."""

    page: str = "jobs"
    title: str
    jobs: list[JobInfo]
    limit: int = Field(description="At most this many are listed.")


def jobs_page(session: Session, *, limit: int) -> JobsContext:
    found = jobs.recent_jobs(session=session, limit=limit)
    listed = [JobInfo.model_validate(job, from_attributes=True) for job in found]
    return JobsContext(title="ffmem: jobs", jobs=listed, limit=limit)


def job_page(
    session: Session, job: Job, *, max_attempts: int | None = None, local_worker: bool = False
) -> JobContext:
    run = job.run
    progress = None
    if run is not None and job.kind == JobKind.index:
        progress = Progress.model_validate(run_progress(session, run), from_attributes=True)
    return JobContext(
        title=f"{job.kind} job {job.id}: {job.status}",
        job=JobInfo.model_validate(job, from_attributes=True),
        run=run_info(run) if run is not None else None,
        model=run.model.slug if run is not None else None,
        progress=progress,
        polling=job.status in jobs.ACTIVE,
        max_attempts=max_attempts,
        local_worker=local_worker,
        explainer=explainer_report(session, job),
    )


def explainer_report(session: Session, job: Job) -> ExplainerReport | None:
    """What the run's explanations step says of its local explainer, for an index or composition job whose
    run was explained with one (None otherwise)."""
    if job.run_id is None or job.kind not in (JobKind.index, JobKind.composition):
        return None
    found = analyses.stored_analyses(session=session, run_id=job.run_id).get("explanations")
    if found is None or not (found.data or {}).get("explainer_sides"):
        return None
    data = found.data
    return ExplainerReport(
        sides=data["explainer_sides"],
        failures=data.get("explainer_failures", 0),
        gave_up=data.get("explainer_gave_up", False),
        simulated=data.get("simulated_sides", 0),
        simulation_failures=data.get("simulation_failures", 0),
    )
