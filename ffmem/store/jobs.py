"""The job queue and the shard leases, in the database (no torch here). docs/queue.md says why it is
our own and not a queue library.

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

import hashlib
import json
import os
import socket
import traceback
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from enum import StrEnum

from sqlalchemy import case, delete, exists, insert, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ffmem.engine.errors import FfmemError
from ffmem.store.models import ACTIVE, Job, JobKind, JobStatus, MinedLayerRow, Run, Shard, ShardStatus

__all__ = ["ACTIVE", "Enqueued", "JobKind", "JobStatus", "MiningProgress", "ShardStatus", "StageProgress"]


def now() -> datetime:
    return datetime.now(timezone.utc)


def worker_id() -> str:
    """A worker process's id: host:pid (for people reading it) and a random uuid4 (what makes it unique:
    containers share host names and PIDs). Nothing parses it."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"


def fingerprint(options: dict) -> str:
    """The same options → the same job (order-independent)."""
    return hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()


def job_fingerprint(
    kind: JobKind, options: dict, *, run_id: int | None = None, after_job_id: int | None = None
) -> str:
    """A job's fingerprint: an index job's is its options'; an analysis's adds its kind and its run (or,
    while it waits, the index job it waits for)."""
    if kind == JobKind.index:
        return fingerprint(options)
    target = {"run": run_id} if run_id is not None else {"after": after_job_id}
    return fingerprint({"kind": kind.value, **target, **options})


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


@dataclass(frozen=True)
class MiningProgress:
    """How far a run's mining has come, over all its shards."""

    mining_since: datetime | None  # when its first shard was taken up
    sentences_done: int
    tokens_done: int
    shards: int
    shards_done: int
    fraction: float  # of the run's sentences


# ---- jobs ---------------------------------------------------------------------------------------


# What defines a run (a job's options and fingerprint): settings of these names, fields of the
# worker's IndexOptions. Device, cache and progress are each worker's own.
RUN_FIELDS = (
    "model",
    "corpus",
    "sentences",
    "held_out_every",
    "top_k",
    "shaded_triggers",
    "dtype",
    "max_sentence_tokens",
    "first_position",
    "batch_tokens",
    "shard_sentences",
    "value_tokens",
)


# What an analysis job computes: settings `analysis_<name>`, fields of the worker's AnalysisOptions.
ANALYSIS_FIELDS = ("examples", "keys", "triggers")


def analysis_options(settings, **given) -> dict:
    """An analysis job's options from `given` (None: the setting), with the seed of its samples."""
    chosen = {name: value for name, value in given.items() if value is not None}
    return {name: chosen.get(name, getattr(settings, f"analysis_{name}")) for name in ANALYSIS_FIELDS} | {
        "seed": chosen.get("seed", 0)
    }


def run_options(settings, **given) -> dict:
    """A job's options: what defines its run, from `given` (None: the setting)."""
    chosen = {name: value for name, value in given.items() if value is not None}
    return {name: chosen.get(name, getattr(settings, name)) for name in RUN_FIELDS}


def enqueue(
    *,
    session: Session,
    options: dict,
    again: bool = False,
    kind: JobKind = JobKind.index,
    run_id: int | None = None,
    after_job_id: int | None = None,
) -> tuple[Job, Enqueued]:
    """The job for `options` and what happened (`Enqueued`): an unfinished job with the same
    fingerprint is reused, a failed one queued again, a done one returned (unless `again`). Two
    callers at once get one job: the partial unique index lets one insert, the other gets its job."""
    key = job_fingerprint(kind, options, run_id=run_id, after_job_id=after_job_id)
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
        kind=kind,
        status=JobStatus.queued,
        options=options,
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
    options: dict,
    run_id: int | None = None,
    after: int | None = None,
    again: bool = False,
) -> tuple[Job, Enqueued]:
    """The analysis job of run `run_id`, or of the run index job `after` builds (it waits for it),
    with `options` (examples, keys, triggers, seed); what happened, as `enqueue` says."""
    if (run_id is None) == (after is None):
        raise ValueError("an analysis job needs a run or the index job that builds it")
    if run_id is not None and session.get(Run, run_id).status != "done":  # it waits for its builder
        run_id, after = None, session.scalars(builders(run_id).order_by(Job.id.desc()).limit(1)).one()
    if after is not None:
        index_job = session.get(Job, after)
        if index_job.status == JobStatus.done:
            run_id, after = index_job.run_id, None
    target = {"run_id": run_id, "after_job_id": after}
    return enqueue(session=session, options=options, again=again, kind=JobKind.analysis, **target)


def attach_analyses(*, session: Session, index_job: Job) -> int:
    """Index job `index_job` is done: the analysis jobs waiting for it get its run (and the fingerprint
    of an analysis queued for that run). How many."""
    waiting = session.scalars(
        select(Job).where(Job.after_job_id == index_job.id, Job.run_id.is_(None), Job.status.in_(ACTIVE))
    ).all()
    for job in waiting:
        key = job_fingerprint(job.kind, job.options, run_id=index_job.run_id)
        twin = _active_job(session, key)
        if twin is not None:  # the same analyses, queued for the run meanwhile: one of them is enough
            same = FfmemError(f"job {twin.id} computes the same analyses of run {index_job.run_id}")
            fail_job(session=session, job_id=job.id, error=same)
            continue
        job.run_id, job.fingerprint = index_job.run_id, key
    session.flush()
    return len(waiting)


def set_progress(
    *, session: Session, job_id: int, worker: str, lease: timedelta, progress: StageProgress
) -> bool:
    """Record a job's progress and renew `worker`'s lease; False if it lost it."""
    renewed = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.worker == worker, Job.status == JobStatus.running)
        .values(lease_until=now() + lease, progress=asdict(progress))
    )
    return renewed.rowcount == 1


def retry(*, session: Session, job_id: int) -> Job:
    """Queue a failed job again, with its attempts counted from 0; its run resumes from its
    checkpoints. When an unfinished job with the same options exists meanwhile, that one is returned
    (it does the work) and this one stays failed."""
    job = session.get(Job, job_id)
    twin = _active_job(session, job.fingerprint)
    if twin is not None:
        return twin
    job.status, job.error, job.finished_at = JobStatus.queued, None, None
    job.worker, job.lease_until, job.attempts = None, None, 0
    if job.run is not None and job.run.status == "failed":
        job.run.status, job.run.error, job.run.finished_at = "running", None, None
    if job.run_id is not None:
        unfinished = (Shard.run_id == job.run_id) & (Shard.status != ShardStatus.done)
        session.execute(update(Shard).where(unfinished).values(attempts=0))
    session.flush()
    return job


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
            _give_up(session, job, _job_step(job), attempts=job.attempts, holder=job.worker, lease=lease)
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


def _give_up(
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
        job.run.status, job.run.error, job.run.finished_at = "failed", stored, now()
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


def analysis_jobs(*, session: Session, run_id: int, limit: int = 10) -> list[Job]:
    """The analysis jobs of a run (those waiting for its index job included), newest first."""
    ours = (Job.run_id == run_id) | (Job.run_id.is_(None) & Job.after_job_id.in_(builders(run_id)))
    query = select(Job).where(Job.kind == JobKind.analysis, ours).order_by(Job.id.desc())
    return list(session.scalars(query.limit(limit)))


def recent_jobs(*, session: Session, limit: int = 20) -> list[Job]:
    """The newest jobs first."""
    return list(session.scalars(select(Job).order_by(Job.id.desc()).limit(limit)))


def open_jobs(*, session: Session) -> list[Job]:
    """Running index jobs whose runs are prepared (their shards may be claimable), oldest first."""
    running = (Job.kind == JobKind.index, Job.status == JobStatus.running, Job.run_id.is_not(None))
    query = select(Job).where(*running).order_by(Job.id)
    return list(session.scalars(query))


# ---- shards -------------------------------------------------------------------------------------


def create_shards(*, session: Session, run_id: int, n_sentences: int, shard_sentences: int) -> None:
    """The run's shards, all pending: n = ⌈n_sentences / shard_sentences⌉ of them, shard k mining every
    n-th of the run's mined sentences from the k-th (ffmem.engine.corpus.shard_members); [start, stop)
    is its span when the shards' sentences are listed one shard after another."""
    moment = now()
    n_shards = -(-n_sentences // shard_sentences)
    start = 0
    for index in range(n_shards):
        stop = start + len(range(index, n_sentences, n_shards))
        session.add(
            Shard(
                run_id=run_id,
                index=index,
                start=start,
                stop=stop,
                status=ShardStatus.pending,
                attempts=0,
                batches_done=0,
                sentences_done=0,
                tokens_done=0,
                updated_at=moment,
            )
        )
        start = stop
    session.flush()


def claim_shard(
    *, session: Session, run_id: int, worker: str, lease: timedelta, max_attempts: int
) -> Shard | None:
    """A pending shard of the run, or one whose lease ran out, leased to `worker`. A shard taken up
    `max_attempts` times, its worker dying each time, fails its job with the reason instead (None)."""
    moment = now()
    expired = (Shard.status == ShardStatus.running) & (Shard.lease_until < moment)
    claimable = or_(Shard.status == ShardStatus.pending, expired)
    query = (
        select(Shard)
        .where(Shard.run_id == run_id, claimable)
        .order_by(Shard.index)
        .limit(1)
        .with_for_update(skip_locked=True)
    )
    shard = session.scalars(query).first()
    if shard is None:
        return None
    if shard.status == ShardStatus.running and shard.attempts >= max_attempts:
        its_job = (Job.kind == JobKind.index) & (Job.run_id == run_id) & (Job.status == JobStatus.running)
        job = session.scalars(select(Job).where(its_job)).first()
        if job is not None:
            step = f"mining shard {shard.index}"
            _give_up(session, job, step, attempts=shard.attempts, holder=shard.worker, lease=lease)
        return None
    shard.status, shard.worker, shard.lease_until = ShardStatus.running, worker, moment + lease
    shard.updated_at = moment
    shard.started_at = shard.started_at or moment
    shard.attempts += 1
    session.flush()
    return shard


def hold_shard(*, session: Session, run_id: int, index: int, worker: str, lease: timedelta) -> bool:
    """Renew `worker`'s lease on a shard it mines; False if it lost it (or the shard is done)."""
    held = (
        (Shard.run_id == run_id)
        & (Shard.index == index)
        & (Shard.worker == worker)
        & (Shard.status == ShardStatus.running)
    )
    return session.execute(update(Shard).where(held).values(lease_until=now() + lease)).rowcount == 1


def checkpoint_shard(
    *,
    session: Session,
    shard: Shard,
    worker: str,
    lease: timedelta,
    batches_done: int,
    sentences_done: int,
    tokens_done: int,
    layers: list[bytes] | None,
) -> bool:
    """Record progress and renew the lease; with `layers`, also checkpoint them as the state after
    `batches_done` batches (what a resume starts from). False if the lease was lost."""
    values = dict(
        sentences_done=sentences_done, tokens_done=tokens_done, lease_until=now() + lease, updated_at=now()
    )
    if layers is not None:
        values["batches_done"] = batches_done
    held = (Shard.run_id == shard.run_id) & (Shard.index == shard.index) & (Shard.worker == worker)
    if session.execute(update(Shard).where(held).values(**values)).rowcount != 1:
        return False
    if layers is not None:
        save_layers(session=session, run_id=shard.run_id, shard=shard.index, layers=layers)
    return True


def load_checkpoint(*, session: Session, run_id: int, index: int) -> tuple[list[bytes] | None, int]:
    """(mined layers, the number of batches they hold) of a shard; (None, 0) before its first checkpoint."""
    layers = load_layers(session=session, run_id=run_id, shard=index)
    if layers is None:
        return None, 0
    return layers, session.scalar(
        select(Shard.batches_done).where(Shard.run_id == run_id, Shard.index == index)
    )


def save_layers(*, session: Session, run_id: int, shard: int, layers: list[bytes]) -> None:
    """Replace the mined layers stored under (run, shard)."""
    session.execute(delete(MinedLayerRow).where(MinedLayerRow.run_id == run_id, MinedLayerRow.shard == shard))
    rows = [
        {"run_id": run_id, "shard": shard, "layer": layer, "data": data} for layer, data in enumerate(layers)
    ]
    session.execute(insert(MinedLayerRow), rows)


def load_layers(*, session: Session, run_id: int, shard: int) -> list[bytes] | None:
    """The mined layers stored under (run, shard), in layer order, or None."""
    query = (
        select(MinedLayerRow.data)
        .where(MinedLayerRow.run_id == run_id, MinedLayerRow.shard == shard)
        .order_by(MinedLayerRow.layer)
    )
    layers = list(session.scalars(query))
    return layers or None


def load_snapshot(*, session: Session, run_id: int) -> list[bytes] | None:
    """The run's snapshot (the merge of its finished shards), in layer order, or None before the first."""
    return load_layers(session=session, run_id=run_id, shard=MinedLayerRow.SNAPSHOT)


def save_snapshot(*, session: Session, run_id: int, layers: list[bytes]) -> None:
    """Replace the run's snapshot."""
    save_layers(session=session, run_id=run_id, shard=MinedLayerRow.SNAPSHOT, layers=layers)


def has_layers(*, session: Session, run_id: int) -> bool:
    """Whether anything of the run is mined and stored (a checkpoint or its snapshot)."""
    return session.scalar(select(exists().where(MinedLayerRow.run_id == run_id)))


def layer_parts(*, session: Session, run_id: int, layer: int) -> list[bytes]:
    """Every stored part of one layer of a run: its snapshot and the running shards' checkpoints."""
    query = select(MinedLayerRow.data).where(MinedLayerRow.run_id == run_id, MinedLayerRow.layer == layer)
    return list(session.scalars(query.order_by(MinedLayerRow.shard)))


def lock_run(*, session: Session, run_id: int) -> Run:
    """The run row, locked until the transaction ends: merges into its snapshot happen one at a time."""
    return session.scalars(select(Run).where(Run.id == run_id).with_for_update()).one()


def complete_shard(*, session: Session, shard: Shard, tokens_done: int) -> None:
    """The shard is merged into the snapshot: mark it done and drop its checkpoint."""
    session.execute(
        update(Shard)
        .where(Shard.run_id == shard.run_id, Shard.index == shard.index)
        .values(
            status=ShardStatus.done,
            lease_until=None,
            sentences_done=shard.stop - shard.start,
            tokens_done=tokens_done,
            updated_at=now(),
        )
    )
    session.execute(
        delete(MinedLayerRow).where(MinedLayerRow.run_id == shard.run_id, MinedLayerRow.shard == shard.index)
    )


def drop_layers(*, session: Session, run_id: int) -> None:
    """The run is stored: its mined layers are no longer needed."""
    session.execute(delete(MinedLayerRow).where(MinedLayerRow.run_id == run_id))


def shard_counts(*, session: Session, run_id: int) -> dict[str, int]:
    """How many of the run's shards are pending, running and done."""
    rows = session.execute(select(Shard.status).where(Shard.run_id == run_id)).scalars()
    counts = {status.value: 0 for status in ShardStatus}
    for status in rows:
        counts[status] += 1
    return counts


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


def progress(*, session: Session, run: Run) -> MiningProgress:
    """Sentences and tokens mined so far, over all shards, the share of the corpus, and since when."""
    query = select(Shard.sentences_done, Shard.tokens_done, Shard.status, Shard.started_at)
    rows = session.execute(query.where(Shard.run_id == run.id)).all()
    sentences = sum(r.sentences_done for r in rows)
    started = [r.started_at for r in rows if r.started_at is not None]
    return MiningProgress(
        mining_since=min(started) if started else None,
        sentences_done=sentences,
        tokens_done=sum(r.tokens_done for r in rows),
        shards=len(rows),
        shards_done=sum(r.status == ShardStatus.done for r in rows),
        fraction=sentences / run.n_sentences if run.n_sentences else 0.0,
    )
