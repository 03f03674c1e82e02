"""The job queue and the shard leases, in the database (no torch here).

A job is an index run to build ("index") or the paper's analyses of a finished run ("analysis": one
worker computes them under the job's lease; an analysis queued with its index run waits until that
run is done, then `attach_analyses` gives it the run).

A worker claims a queued index job and prepares its run (model, corpus, shards); then any number of
workers claim the run's shards, each under a lease they renew as they go, checkpoint into the shard
row, and merge into the run's snapshot when the shard is done; the worker that finds every shard done
finishes the run (projection and storage). A worker that dies
loses its lease, and whoever claims the shard or the job next resumes from the last checkpoint.

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
from datetime import datetime, timedelta, timezone

from sqlalchemy import delete, exists, insert, or_, select, update
from sqlalchemy.orm import Session

from ffmem.store.models import Job, MinedLayerRow, Run, Shard

ACTIVE = ("queued", "running")
SNAPSHOT = -1  # the `shard` of a run's merged mined layers


def now() -> datetime:
    return datetime.now(timezone.utc)


def worker_name() -> str:
    """host:pid:random — unique per worker process."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def fingerprint(options: dict) -> str:
    """The same options → the same job (order-independent)."""
    return hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()


def job_fingerprint(kind: str, options: dict) -> str:
    """A job's fingerprint: its options', with its kind for other kinds than index runs (whose
    fingerprints predate the kinds)."""
    return fingerprint(options if kind == "index" else {"kind": kind, **options})


# ---- jobs ---------------------------------------------------------------------------------------


# What defines a run (a job's options and fingerprint): settings of these names, fields of the
# worker's IndexOptions. Device, cache and progress are each worker's own.
RUN_FIELDS = (
    "model",
    "corpus",
    "sentences",
    "top_k",
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
    *, session: Session, options: dict, again: bool = False, kind: str = "index", run_id: int | None = None
) -> tuple[Job, str]:
    """The job for `options` and what happened: "created", "resumed" (an unfinished job with the same
    options exists) or "done" (already built; `again=True` queues a new one anyway)."""
    key = job_fingerprint(kind, options)
    query = select(Job).where(Job.fingerprint == key).order_by(Job.id.desc()).limit(1)
    existing = session.scalars(query).first()
    if existing is not None and existing.status in ACTIVE:
        return existing, "resumed"
    if existing is not None and existing.status == "done" and not again:
        return existing, "done"
    if existing is not None and existing.status == "failed" and not again:
        retry(session=session, job_id=existing.id)
        return existing, "resumed"
    job = Job(
        kind=kind,
        status="queued",
        options=options,
        fingerprint=key,
        run_id=run_id,
        attempts=0,
        created_at=now(),
    )
    session.add(job)
    session.flush()
    return job, "created"


def enqueue_analysis(
    *,
    session: Session,
    options: dict,
    run_id: int | None = None,
    after: int | None = None,
    again: bool = False,
) -> tuple[Job, str]:
    """The analysis job of run `run_id`, or of the run index job `after` builds (it waits for it),
    with `options` (examples, keys, triggers, seed); what happened, as `enqueue` says."""
    if (run_id is None) == (after is None):
        raise ValueError("an analysis job needs a run or the index job that builds it")
    if run_id is not None and session.get(Run, run_id).status != "done":  # it waits for its builder
        builder = select(Job.id).where(Job.kind == "index", Job.run_id == run_id).order_by(Job.id.desc())
        run_id, after = None, session.scalars(builder.limit(1)).one()
    if after is not None:
        index_job = session.get(Job, after)
        if index_job.status == "done":
            run_id, after = index_job.run_id, None
    target = {"run": run_id} if after is None else {"after": after}
    return enqueue(session=session, options=target | options, again=again, kind="analysis", run_id=run_id)


def attach_analyses(*, session: Session, index_job: Job) -> int:
    """Index job `index_job` is done: the analysis jobs waiting for it get its run. How many."""
    waiting = session.scalars(
        select(Job).where(Job.kind == "analysis", Job.run_id.is_(None), Job.status.in_(ACTIVE))
    ).all()
    attached = [job for job in waiting if job.options.get("after") == index_job.id]
    for job in attached:  # now the same job as one queued for the run: one fingerprint
        options = {"run": index_job.run_id} | {k: v for k, v in job.options.items() if k != "after"}
        job.run_id, job.options = index_job.run_id, options
        job.fingerprint = job_fingerprint(job.kind, options)
    session.flush()
    return len(attached)


def set_progress(*, session: Session, job_id: int, worker: str, lease: timedelta, progress: dict) -> bool:
    """Record a job's progress ({stage, done, total}) and renew `worker`'s lease; False if it lost it."""
    renewed = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.worker == worker)
        .values(lease_until=now() + lease, progress=progress)
    )
    return renewed.rowcount == 1


def retry(*, session: Session, job_id: int) -> Job:
    """Queue a failed job again; its run resumes from its checkpoints."""
    job = session.get(Job, job_id)
    job.status, job.error, job.finished_at, job.worker, job.lease_until = "queued", None, None, None, None
    if job.run is not None and job.run.status == "failed":
        job.run.status, job.run.error, job.run.finished_at = "running", None, None
    session.flush()
    return job


def claim_job(*, session: Session, worker: str, lease: timedelta, job_id: int | None = None) -> Job | None:
    """A job for `worker` to prepare or finish, leased to it: a queued one, a running one whose
    preparation died, or a running one whose shards are all mined and that nobody is finishing.
    None when there is nothing to claim."""
    moment = now()
    unmined = exists().where(Shard.run_id == Job.run_id, Shard.status != "done")
    unheld = or_(Job.lease_until.is_(None), Job.lease_until < moment)
    # Running and nobody holds it: its preparation died (no run yet), or its shards are all mined.
    orphaned = (Job.status == "running") & unheld & (Job.run_id.is_(None) | ~unmined)
    # An analysis waits for its run (run_id is set once the run is done).
    ready = (Job.kind == "index") | Job.run_id.is_not(None)
    claimable = or_(Job.status == "queued", orphaned) & ready
    query = select(Job).where(claimable).order_by(Job.id).limit(1).with_for_update(skip_locked=True)
    if job_id is not None:
        query = query.where(Job.id == job_id)
    job = session.scalars(query).first()
    if job is None:
        return None
    job.status, job.worker, job.lease_until = "running", worker, moment + lease
    job.started_at = job.started_at or moment
    job.attempts += 1
    session.flush()
    return job


def hold_job(*, session: Session, job_id: int, worker: str, lease: timedelta) -> bool:
    """Renew `worker`'s lease on a job it prepares or finishes; False if it lost it."""
    renewed = session.execute(
        update(Job).where(Job.id == job_id, Job.worker == worker).values(lease_until=now() + lease)
    )
    return renewed.rowcount == 1


def release_job(*, session: Session, job_id: int) -> None:
    """The job's run is prepared: its shards are open to every worker; nobody holds the job now."""
    session.execute(update(Job).where(Job.id == job_id).values(worker=None, lease_until=None))


def finish_job(*, session: Session, job_id: int) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(status="done", worker=None, lease_until=None, finished_at=now())
    )


def fail_job(*, session: Session, job_id: int, error: BaseException) -> None:
    """Mark the job and its run failed, with {type, message, traceback}."""
    stored = {
        "type": type(error).__name__,
        "message": str(error),
        "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
    }
    job = session.get(Job, job_id)
    job.status, job.error, job.finished_at, job.worker, job.lease_until = "failed", stored, now(), None, None
    if job.run is not None and job.kind == "index":  # failed analyses leave their run as it is
        job.run.status, job.run.error, job.run.finished_at = "failed", stored, now()
    session.flush()


def building(*, session: Session, model_id: int) -> Job | None:
    """The newest queued or running index job whose run is of this model, if any."""
    query = (
        select(Job)
        .join(Run, Job.run_id == Run.id)
        .where(Run.model_id == model_id, Job.kind == "index", Job.status.in_(ACTIVE))
        .order_by(Job.id.desc())
        .limit(1)
    )
    return session.scalars(query).first()


def analysis_jobs(*, session: Session, run_id: int, limit: int = 10) -> list[Job]:
    """The analysis jobs of a run (those waiting for it to be built included), newest first."""
    ours = (Job.run_id == run_id) | (Job.run_id.is_(None) & Job.status.in_(ACTIVE))
    query = select(Job).where(Job.kind == "analysis", ours).order_by(Job.id.desc())
    found = session.scalars(query.limit(limit)).all()
    builders = set(session.scalars(select(Job.id).where(Job.kind == "index", Job.run_id == run_id)))
    return [job for job in found if job.run_id == run_id or job.options.get("after") in builders]


def recent_jobs(*, session: Session, limit: int = 20) -> list[Job]:
    """The newest jobs first."""
    return list(session.scalars(select(Job).order_by(Job.id.desc()).limit(limit)))


def open_jobs(*, session: Session) -> list[Job]:
    """Running index jobs whose runs are prepared (their shards may be claimable), oldest first."""
    running = (Job.kind == "index", Job.status == "running", Job.run_id.is_not(None))
    query = select(Job).where(*running).order_by(Job.id)
    return list(session.scalars(query))


# ---- shards -------------------------------------------------------------------------------------


def create_shards(*, session: Session, run_id: int, n_sentences: int, shard_sentences: int) -> None:
    """The run's shards, all pending."""
    moment = now()
    for index, start in enumerate(range(0, n_sentences, shard_sentences)):
        session.add(
            Shard(
                run_id=run_id,
                index=index,
                start=start,
                stop=min(start + shard_sentences, n_sentences),
                status="pending",
                batches_done=0,
                sentences_done=0,
                tokens_done=0,
                updated_at=moment,
            )
        )
    session.flush()


def claim_shard(*, session: Session, run_id: int, worker: str, lease: timedelta) -> Shard | None:
    """A pending shard of the run, or one whose lease ran out, leased to `worker`."""
    moment = now()
    claimable = or_(Shard.status == "pending", (Shard.status == "running") & (Shard.lease_until < moment))
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
    shard.status, shard.worker, shard.lease_until, shard.updated_at = (
        "running",
        worker,
        moment + lease,
        moment,
    )
    shard.started_at = shard.started_at or moment
    session.flush()
    return shard


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
            status="done",
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
    counts = {"pending": 0, "running": 0, "done": 0}
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
    """End `worker`'s leases now (it is stopping): others may take its shard or job at once."""
    for model in (Job, Shard):
        session.execute(update(model).where(model.worker == worker).values(lease_until=now()))


def expire_dead_leases(*, session: Session) -> int:
    """End the leases of workers on this host whose process is gone (a crash or SIGKILL): rerunning
    the same command resumes at once instead of waiting the lease out. Returns how many ended."""
    host = socket.gethostname()
    ended = 0
    for model in (Job, Shard):
        query = (
            select(model.worker).where(model.worker.like(f"{host}:%"), model.lease_until > now()).distinct()
        )
        for holder in session.scalars(query).all():
            pid = int(holder.split(":")[1])
            if not _alive(pid):
                ended += session.execute(
                    update(model).where(model.worker == holder).values(lease_until=now())
                ).rowcount
    return ended


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def progress(*, session: Session, run: Run) -> dict:
    """Sentences and tokens mined so far, over all shards, the share of the corpus, and since when."""
    query = select(Shard.sentences_done, Shard.tokens_done, Shard.status, Shard.started_at)
    rows = session.execute(query.where(Shard.run_id == run.id)).all()
    sentences = sum(r.sentences_done for r in rows)
    started = [r.started_at for r in rows if r.started_at is not None]
    return {
        "mining_since": min(started) if started else None,
        "sentences_done": sentences,
        "tokens_done": sum(r.tokens_done for r in rows),
        "shards": len(rows),
        "shards_done": sum(r.status == "done" for r in rows),
        "fraction": sentences / run.n_sentences if run.n_sentences else 0.0,
    }
