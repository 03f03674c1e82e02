"""How far a run being built has come, for the run and job pages: `mining_job` (the index job building a run
still mining, and the share of its corpus mined) and `run_progress` (sentences, tokens and shards done over
all its shards, the rate and the time left at it), from the shards' counts (ffmem.store.shards.progress)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy.orm import Session

from ffmem.store import jobs, models, shards
from ffmem.store.models import Job, Run, RunStatus


def mining_job(session: Session, run: Run) -> tuple[Job, float] | None:
    """While the run mines: the index job building it and the share of its corpus mined so far (all
    shards, beyond their checkpoints); None once it is stored or failed."""
    if run.status != RunStatus.running:
        return None
    job = session.scalars(jobs.builders(run.id).order_by(Job.id.desc()).limit(1)).first()
    return None if job is None else (job, shards.progress(session=session, run=run).fraction)


@dataclass(frozen=True)
class RunProgress:
    """How far a run's mining has come, over all its shards (a stored run: all of it)."""

    sentences_done: int
    n_sentences: int
    fraction: float
    tokens_done: int
    shards: int
    shards_done: int
    tokens_per_s: float | None  # None once stored, or before a sentence is mined
    eta_seconds: float | None


def run_progress(session: Session, run: Run) -> RunProgress:
    """The run's mining so far, its rate and the time left at that rate (none once stored)."""
    done = shards.progress(session=session, run=run)
    since = done.mining_since
    elapsed = (models.now() - _aware(since)).total_seconds() if since else 0.0
    rate = done.sentences_done / elapsed if elapsed > 0 and done.sentences_done else None
    finished = run.status == RunStatus.done
    return RunProgress(
        sentences_done=run.n_sentences if finished else done.sentences_done,
        n_sentences=run.n_sentences,
        fraction=1.0 if finished else done.fraction,
        tokens_done=done.tokens_done,
        shards=done.shards,
        shards_done=done.shards_done,
        tokens_per_s=done.tokens_done / elapsed if rate and not finished else None,
        eta_seconds=(run.n_sentences - done.sentences_done) / rate if rate and not finished else None,
    )


def _aware(moment: datetime) -> datetime:
    """SQLite gives back naive datetimes; they were stored as UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
