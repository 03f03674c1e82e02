"""The job queue and the leases on jobs and shards, in the database (no torch here; the shards
themselves are in ffmem.store.shards). docs/queue.md says why it is our own and not a queue library.

A job is an index run to build (`JobKind.index`) or the paper's analyses of a finished run
(`JobKind.analysis`: one worker computes them under the job's lease; an analysis queued with its index
run waits for that job, `Job.after_job_id`, until its run is done; then `attach_analyses` gives it the
run).

A worker claims a queued index job and prepares its run (model, corpus, shards); then any number of
workers claim the run's shards, each under a lease, checkpoint into the shard row, and merge into the
run's snapshot when the shard is done; the worker that finds every shard done finishes the run
(projection and storage). A worker that dies loses its lease, and whoever claims the shard or the job
next resumes from the last checkpoint.

The queue's rules:
- one unfinished job per fingerprint (the same options): a partial unique index, so two `ffmem index`
  started at once make one job (`enqueue` inserts with ON CONFLICT DO NOTHING and returns the other);
- leases: a worker holds a job or shard until `lease_until`; its heartbeat (ffmem.worker.leases) renews
  it while a step runs, so a step may take longer than the lease and keep it;
- attempts: a step (preparing, finishing, an analysis, a shard) taken up `max_attempts` times, its
  worker dying each time, fails its job with the reason instead of being taken up forever;
- worker ids are random per process (`worker_id`), never parsed: whether a holder is dead is asked of
  its presence file (ffmem.worker.leases), not of its host name and PID, which containers share.

On Postgres claims take row locks with FOR UPDATE SKIP LOCKED, so workers on many machines share one
database. SQLite has no row locks: it runs one worker at a time (`other_live_worker` tells).
"""

from __future__ import annotations

import os
import socket
import traceback
import uuid
from dataclasses import asdict, dataclass
from datetime import timedelta
from enum import StrEnum

from sqlalchemy import case, exists, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ffmem.engine.errors import FfmemError
from ffmem.store.models import (
    ACTIVE,
    SPECS,
    Analysis,
    Job,
    JobKind,
    JobStatus,
    Run,
    RunStatus,
    Shard,
    ShardStatus,
    now,
)
from ffmem.store.specs import AnalysisSpec, RunSpec, Spec, fingerprint

__all__ = ["ACTIVE", "Enqueued", "JobKind", "JobStatus", "ShardStatus", "StageProgress"]


def worker_id() -> str:
    """A worker process's id: host:pid (for people reading it) and a random uuid4 (what makes it unique:
    containers share host names and PIDs). Nothing parses it."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"


KINDS = {spec: kind for kind, spec in SPECS.items()}  # the kind of job that computes each spec


def job_fingerprint(spec: Spec, *, run_id: int | None = None, after_job_id: int | None = None) -> str:
    """A job's fingerprint: an index job's is its spec's; another's adds its kind and its run (or, while
    an analysis waits, the index job it waits for)."""
    kind = KINDS[type(spec)]
    if kind == JobKind.index:
        return fingerprint(spec.options())
    target = {"run": run_id} if run_id is not None else {"after": after_job_id}
    return fingerprint({"kind": kind.value, **target, **spec.options()})


class Enqueued(StrEnum):
    """What `enqueue` did."""

    created = "created"  # a new job
    resumed = "resumed"  # an unfinished job with these options exists (a failed one is queued again)
    done = "done"  # a finished one exists (`again=True` queues a new one anyway)


class TooManyAttempts(FfmemError):
    """A step was taken up `max_attempts` times and its worker died each time."""


@dataclass(frozen=True)
class StageProgress:
    """How far the step a job's worker is on has come: `done` of `total` batches of `stage` (an
    analysis's name). Stored in `Job.progress` as a dict."""

    stage: str
    done: int
    total: int


# ---- jobs ---------------------------------------------------------------------------------------


def enqueue_run(
    *,
    session: Session,
    spec: RunSpec,
    again: bool = False,
    analysis: AnalysisSpec | None = None,
    keep_analyses: bool = False,
) -> tuple[Job, Enqueued, Job | None]:
    """The index job of run `spec`, what happened (as `enqueue` says) and, with `analysis`, the
    analysis job of that run (it waits for the index job). With `keep_analyses`, a run built before
    that has analyses keeps them: none is queued (`ffmem demo`'s small ones never replace others)."""
    job, what = enqueue(session=session, spec=spec, again=again)
    if analysis is None or (keep_analyses and what == Enqueued.done and _analyzed(session, job.run_id)):
        return job, what, None
    analysis_job, _ = enqueue_analysis(session=session, spec=analysis, after=job.id)
    return job, what, analysis_job


def _analyzed(session: Session, run_id: int) -> bool:
    """Whether run `run_id` has any analysis stored."""
    return session.scalar(select(exists().where(Analysis.run_id == run_id)))


def enqueue(
    *,
    session: Session,
    spec: Spec,
    again: bool = False,
    run_id: int | None = None,
    after_job_id: int | None = None,
) -> tuple[Job, Enqueued]:
    """The job that computes `spec` and what happened (`Enqueued`): an unfinished job with the same
    fingerprint is reused, a failed one queued again, a done one returned (unless `again`). Two
    callers at once get one job: the partial unique index lets one insert, the other gets its job."""
    key = job_fingerprint(spec, run_id=run_id, after_job_id=after_job_id)
    active = _active_job(session, key)
    if active is not None:
        return active, Enqueued.resumed
    same = select(Job).where(Job.fingerprint == key).order_by(Job.id.desc())
    newest = session.scalars(same.limit(1)).first()
    if newest is not None and newest.status == JobStatus.done and not again:
        return newest, Enqueued.done
    if newest is not None and newest.status == JobStatus.failed and not again:
        return retry(session=session, job_id=newest.id), Enqueued.resumed
    values = dict(
        kind=KINDS[type(spec)],
        status=JobStatus.queued,
        options=spec.options(),
        fingerprint=key,
        run_id=run_id,
        after_job_id=after_job_id,
        attempts=0,
        created_at=now(),
    )
    created = session.scalars(_insert_unless_active(session).values(**values).returning(Job.id)).first()
    if created is None:  # another caller's job, inserted since we looked
        return _active_job(session, key), Enqueued.resumed
    return session.get(Job, created), Enqueued.created


def _insert_unless_active(session: Session):
    """INSERT INTO jobs … ON CONFLICT DO NOTHING: a job whose fingerprint an unfinished job has is not
    inserted (and no IntegrityError aborts the caller's transaction; SQLite's savepoints can't be
    trusted to undo just the insert)."""
    dialect = session.get_bind().dialect.name
    module = {"postgresql": postgresql, "sqlite": sqlite}.get(dialect)
    if module is None:
        raise FfmemError(f"the job queue runs on SQLite or Postgres, not {dialect}")
    return module.insert(Job).on_conflict_do_nothing()


def _active_job(session: Session, key: str) -> Job | None:
    """The unfinished job with this fingerprint (there is at most one)."""
    return session.scalars(select(Job).where(Job.fingerprint == key, Job.status.in_(ACTIVE))).first()


def enqueue_analysis(
    *,
    session: Session,
    spec: AnalysisSpec,
    run_id: int | None = None,
    after: int | None = None,
    again: bool = False,
) -> tuple[Job, Enqueued]:
    """The analysis job of run `run_id`, or of the run index job `after` builds (it waits for it),
    computing `spec`; what happened, as `enqueue` says."""
    if (run_id is None) == (after is None):
        raise ValueError("an analysis job needs a run or the index job that builds it")
    if run_id is not None and session.get(Run, run_id).status != RunStatus.done:  # it waits for its builder
        run_id, after = None, session.scalars(builders(run_id).order_by(Job.id.desc()).limit(1)).one()
    if after is not None:
        index_job = session.get(Job, after)
        if index_job.status == JobStatus.done:
            run_id, after = index_job.run_id, None
    target = {"run_id": run_id, "after_job_id": after}
    return enqueue(session=session, spec=spec, again=again, **target)


def attach_analyses(*, session: Session, index_job: Job) -> int:
    """Index job `index_job` is done: the analysis jobs waiting for it get its run (and the fingerprint
    of an analysis queued for that run). How many."""
    waiting = session.scalars(
        select(Job).where(Job.after_job_id == index_job.id, Job.run_id.is_(None), Job.status.in_(ACTIVE))
    ).all()
    for job in waiting:
        key = job_fingerprint(job.spec, run_id=index_job.run_id)
        twin = _active_job(session, key)
        if twin is not None:  # the same analyses, queued for the run meanwhile: one of them is enough
            same = FfmemError(f"job {twin.id} computes the same analyses of run {index_job.run_id}")
            fail_job(session=session, job_id=job.id, error=same)
            continue
        job.run_id, job.fingerprint = index_job.run_id, key
    session.flush()
    return len(waiting)


def set_progress(*, session: Session, job_id: int, worker: str, progress: StageProgress) -> None:
    """Record how far `worker`'s step on a job has come (while it holds the job; its heartbeat renews
    the lease)."""
    held = (Job.id == job_id) & (Job.worker == worker) & (Job.status == JobStatus.running)
    session.execute(update(Job).where(held).values(progress=asdict(progress)))


def retry(*, session: Session, job_id: int) -> Job:
    """Queue a failed job again as its next attempt: the failed one (its start, end and error) goes to
    `past_attempts`, the new one starts when a worker takes it up, its steps' take-ups counted from 0; its
    run resumes from its checkpoints. When an unfinished job with the same options exists meanwhile, that
    one is returned (it does the work) and this one stays failed."""
    job = session.get(Job, job_id)
    twin = _active_job(session, job.fingerprint)
    if twin is not None:
        return twin
    job.past_attempts = [*(job.past_attempts or []), _attempt(job)]
    job.status, job.error, job.started_at, job.finished_at = JobStatus.queued, None, None, None
    job.worker, job.lease_until, job.attempts = None, None, 0
    if job.run is not None and job.run.status == RunStatus.failed:
        job.run.status, job.run.error, job.run.finished_at = RunStatus.running, None, None
    if job.run_id is not None:
        unfinished = (Shard.run_id == job.run_id) & (Shard.status != ShardStatus.done)
        session.execute(update(Shard).where(unfinished).values(attempts=0))
    session.flush()
    return job


def _attempt(job: Job) -> dict:
    """A failed attempt as `Job.past_attempts` keeps it: when it started (null: no worker took it up) and
    failed, and why."""
    started = None if job.started_at is None else job.started_at.isoformat()
    return {"started_at": started, "finished_at": job.finished_at.isoformat(), "error": job.error}


def claim_job(
    *,
    session: Session,
    worker: str,
    lease: timedelta,
    max_attempts: int,
    job_id: int | None = None,
) -> Job | None:
    """A job for `worker` to prepare or finish, leased to it: a queued one, a running one whose
    preparation died, or a running one whose shards are all mined and that nobody is finishing.
    A job whose step was taken up `max_attempts` times, its worker dying each time, is failed with
    the reason instead. None when there is nothing to claim."""
    while True:
        moment = now()
        unmined = exists().where(Shard.run_id == Job.run_id, Shard.status != ShardStatus.done)
        unheld = or_(Job.lease_until.is_(None), Job.lease_until < moment)
        # Running and nobody holds it: its preparation died (no run yet), or its shards are all mined.
        orphaned = (Job.status == JobStatus.running) & unheld & (Job.run_id.is_(None) | ~unmined)
        # An analysis waits for its run (run_id is set once the run is done).
        ready = (Job.kind == JobKind.index) | Job.run_id.is_not(None)
        claimable = or_(Job.status == JobStatus.queued, orphaned) & ready
        query = select(Job).where(claimable).order_by(Job.id).limit(1).with_for_update(skip_locked=True)
        if job_id is not None:
            query = query.where(Job.id == job_id)
        job = session.scalars(query).first()
        if job is None:
            return None
        died = job.status == JobStatus.running and job.worker is not None  # its lease ran out
        if died and job.attempts >= max_attempts:
            give_up(session, job, _job_step(job), attempts=job.attempts, holder=job.worker, lease=lease)
            continue
        job.status, job.worker, job.lease_until = JobStatus.running, worker, moment + lease
        job.started_at = job.started_at or moment
        job.attempts += 1
        session.flush()
        return job


def _job_step(job: Job) -> str:
    if job.kind == JobKind.analysis:
        return "computing the analyses"
    if job.kind == JobKind.comparison:
        return "comparing two runs"
    return "preparing the run" if job.run_id is None else "storing the run"


def give_up(
    session: Session, job: Job, step: str, *, attempts: int, holder: str | None, lease: timedelta
) -> None:
    """Fail `job`: its `step` was taken up `attempts` times and its worker died each time."""
    error = TooManyAttempts(
        f"failed after {attempts} attempts: the worker died each time while {step} (its lease of "
        f"{lease.total_seconds():g} s ran out before it finished; the last was {holder}). It may have been "
        "killed for memory (see the kernel log) or stopped: fix the cause and retry the job; "
        "FFMEM_MAX_ATTEMPTS sets how many attempts a step gets"
    )
    fail_job(session=session, job_id=job.id, error=error)


def hold_job(*, session: Session, job_id: int, worker: str, lease: timedelta) -> bool:
    """Renew `worker`'s lease on a job it prepares or finishes; False if it lost it."""
    held = (Job.id == job_id) & (Job.worker == worker) & (Job.status == JobStatus.running)
    renewed = session.execute(update(Job).where(held).values(lease_until=now() + lease))
    return renewed.rowcount == 1


def release_job(*, session: Session, job_id: int) -> None:
    """The job's step ended (its run is prepared: its shards are open to every worker): nobody holds
    it now, and the next step's attempts count from 0."""
    session.execute(update(Job).where(Job.id == job_id).values(worker=None, lease_until=None, attempts=0))


def finish_job(*, session: Session, job_id: int) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(status=JobStatus.done, worker=None, lease_until=None, finished_at=now())
    )


def fail_job(*, session: Session, job_id: int, error: BaseException) -> None:
    """Mark the job and its run failed, with {type, message, traceback}."""
    stored = {
        "type": type(error).__name__,
        "message": str(error),
        "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
    }
    job = session.get(Job, job_id)
    job.status, job.error, job.finished_at = JobStatus.failed, stored, now()
    job.worker, job.lease_until = None, None
    if job.run is not None and job.kind == JobKind.index:  # failed analyses leave their run as it is
        job.run.status, job.run.error, job.run.finished_at = RunStatus.failed, stored, now()
    session.flush()


def building(*, session: Session, model_id: int) -> Job | None:
    """The newest queued or running index job whose run is of this model, if any."""
    query = (
        select(Job)
        .join(Run, Job.run_id == Run.id)
        .where(Run.model_id == model_id, Job.kind == JobKind.index, Job.status.in_(ACTIVE))
        .order_by(Job.id.desc())
        .limit(1)
    )
    return session.scalars(query).first()


def preparing(*, session: Session) -> list[Job]:
    """The queued or running index jobs that have not stored their run yet (their model may not be
    stored either), oldest first."""
    query = select(Job).where(Job.kind == JobKind.index, Job.status.in_(ACTIVE), Job.run_id.is_(None))
    return list(session.scalars(query.order_by(Job.id)))


def builders(run_id: int):
    """SELECT the ids of the index jobs of run `run_id` (for IN)."""
    return select(Job.id).where(Job.kind == JobKind.index, Job.run_id == run_id)


def built_by(*, session: Session, run_id: int) -> Job | None:
    """The newest index job of run `run_id` (None for a run that has none any more)."""
    query = select(Job).where(Job.id.in_(builders(run_id))).order_by(Job.id.desc()).limit(1)
    return session.scalars(query).first()


def analysis_jobs(*, session: Session, run_id: int, limit: int = 10) -> list[Job]:
    """The analysis jobs of a run (those waiting for its index job included), newest first."""
    ours = (Job.run_id == run_id) | (Job.run_id.is_(None) & Job.after_job_id.in_(builders(run_id)))
    query = select(Job).where(Job.kind == JobKind.analysis, ours).order_by(Job.id.desc())
    return list(session.scalars(query.limit(limit)))


def recent_jobs(*, session: Session, limit: int = 20) -> list[Job]:
    """The newest jobs first."""
    return list(session.scalars(select(Job).order_by(Job.id.desc()).limit(limit)))


def in_progress(*, session: Session) -> bool:
    """Whether any job is queued or running."""
    return session.scalar(select(exists().where(Job.status.in_(ACTIVE))))


def open_jobs(*, session: Session) -> list[Job]:
    """Running index jobs whose runs are prepared (their shards may be claimable), oldest first."""
    running = (Job.kind == JobKind.index, Job.status == JobStatus.running, Job.run_id.is_not(None))
    query = select(Job).where(*running).order_by(Job.id)
    return list(session.scalars(query))


def other_live_worker(*, session: Session, worker: str) -> str | None:
    """Another worker holding a live lease (on a job or a shard), if any."""
    moment = now()
    for model in (Job, Shard):
        query = select(model.worker).where(
            model.worker.is_not(None), model.worker != worker, model.lease_until > moment
        )
        holder = session.scalars(query.limit(1)).first()
        if holder is not None:
            return holder
    return None


def release_leases(*, session: Session, worker: str) -> None:
    """`worker` is stopping: what it holds goes back now, its attempt not counted (it did not die).
    Others may take its job or shard at once."""
    given_back = case((Job.attempts > 0, Job.attempts - 1), else_=0)
    mine = (Job.worker == worker) & (Job.status == JobStatus.running)
    session.execute(update(Job).where(mine).values(worker=None, lease_until=None, attempts=given_back))
    given_back = case((Shard.attempts > 0, Shard.attempts - 1), else_=0)
    mine = (Shard.worker == worker) & (Shard.status == ShardStatus.running)
    session.execute(update(Shard).where(mine).values(lease_until=now(), attempts=given_back))


def lease_holders(*, session: Session) -> set[str]:
    """The workers holding a live lease (on a job or a shard)."""
    moment = now()
    holders: set[str] = set()
    for model in (Job, Shard):
        query = select(model.worker).where(model.worker.is_not(None), model.lease_until > moment).distinct()
        holders.update(session.scalars(query))
    return holders


def end_leases(*, session: Session, worker: str) -> int:
    """End the live leases of `worker`, known to be dead (its process is gone): others may take its work
    at once instead of waiting the lease out; that attempt counts. Returns how many ended."""
    moment = now()
    ended = 0
    for model in (Job, Shard):
        held = (model.worker == worker) & (model.lease_until > moment)
        ended += session.execute(update(model).where(held).values(lease_until=moment)).rowcount
    return ended
