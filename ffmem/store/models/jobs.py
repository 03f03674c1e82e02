"""The work queue and what it mines: `Job` (its `JobKind`, `JobStatus`, typed `spec`), `Shard` (the unit
workers claim, its `ShardStatus`) and `MinedLayerRow` (a shard's checkpoint or the run's merged snapshot)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import ClassVar

from sqlalchemy import (
    JSON,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    text,
)
from sqlalchemy.orm import Mapped, deferred, mapped_column, relationship

from ffmem.store.models.base import Base, stored_as_text
from ffmem.store.models.runs import Run
from ffmem.store.specs import AnalysisSpec, ComparisonSpec, CompositionSpec, RunSpec


class JobKind(StrEnum):
    """What a job does: build an index run, compute the paper's analyses of a finished one, compare two
    finished runs (ffmem.worker.comparison), or compute a finished run's weight graph and explanations
    again (ffmem.worker.composition)."""

    index = "index"
    analysis = "analysis"
    comparison = "comparison"
    composition = "composition"


class JobStatus(StrEnum):
    """Where a job is: queued (nobody took it yet), running (a worker holds it, or its run's shards are
    open to every worker), done, failed (its error says why; it can be retried)."""

    queued = "queued"
    running = "running"
    done = "done"
    failed = "failed"


ACTIVE = (JobStatus.queued, JobStatus.running)  # unfinished: at most one such job per fingerprint
SPECS = {
    JobKind.index: RunSpec,
    JobKind.analysis: AnalysisSpec,
    JobKind.comparison: ComparisonSpec,
    JobKind.composition: CompositionSpec,
}


class ShardStatus(StrEnum):
    """pending (nobody mined it yet), running (under a worker's lease, or its lease ran out), done
    (merged into its run's snapshot)."""

    pending = "pending"
    running = "running"
    done = "done"


class Job(Base):
    """A piece of work for the workers, queued until claimed: an index run (`JobKind.index`) or the paper's
    analyses of a finished run (`JobKind.analysis`; its `run_id` is set once that run is done; until
    then it waits for the index job `after_job_id` that builds it).

    The same options give the same `fingerprint`: running the same `ffmem index` again finds the
    unfinished job and resumes its run instead of starting over. At most one queued or running job has
    a fingerprint (a partial unique index), so two `ffmem index` started at once make one job.
    """

    __tablename__ = "jobs"
    __table_args__ = (
        Index(
            "uq_jobs_active_fingerprint",
            "fingerprint",
            unique=True,
            sqlite_where=text("status IN ('queued', 'running')"),
            postgresql_where=text("status IN ('queued', 'running')"),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[JobKind] = mapped_column(stored_as_text(JobKind, "kind"))
    status: Mapped[JobStatus] = mapped_column(stored_as_text(JobStatus, "status"), index=True)
    options: Mapped[dict] = mapped_column(JSON)  # what the job computes: its spec's fields (`spec`)
    fingerprint: Mapped[str] = mapped_column(String(64), index=True)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    # An analysis queued with its index run waits for that job (its run_id is set when the run is done).
    after_job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    worker: Mapped[str | None] = mapped_column(String(200))  # the id of who holds the job (jobs.worker_id)
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Times a worker took up the job's current step (preparing, finishing, the analysis); past
    # Settings.max_attempts, the worker having died each time, the job fails.
    attempts: Mapped[int] = mapped_column(Integer)
    error: Mapped[dict | None] = mapped_column(JSON)  # {type, message, traceback}
    # The attempts that failed before this one, oldest first: {started_at, finished_at (ISO), error}
    # each (jobs.retry moves a failed attempt here); NULL: none (or stored before revision 0027).
    past_attempts: Mapped[list[dict] | None] = mapped_column(JSON)
    progress: Mapped[dict | None] = mapped_column(JSON)  # analyses: jobs.StageProgress as a dict
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    run: Mapped[Run | None] = relationship()

    @property
    def spec(self) -> RunSpec | AnalysisSpec | ComparisonSpec | CompositionSpec:
        """What the job computes, typed by its kind (ffmem.store.specs)."""
        return SPECS[self.kind].stored(self.options)

    @property
    def attempt(self) -> int:
        """The current attempt's number: 1, and one more for each failed attempt before it."""
        return 1 + len(self.past_attempts or [])


class Shard(Base):
    """Sentences [start, stop) of a run's corpus: the unit workers claim (with a lease), checkpoint and merge.

    Its checkpoint (MinedLayer rows under its index) holds the state after `batches_done` batches;
    when the shard is done it is merged into the run's snapshot (rows under `MinedLayerRow.SNAPSHOT`)
    and dropped.
    """

    __tablename__ = "shards"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    start: Mapped[int] = mapped_column(Integer)
    stop: Mapped[int] = mapped_column(Integer)
    status: Mapped[ShardStatus] = mapped_column(stored_as_text(ShardStatus, "status"))
    worker: Mapped[str | None] = mapped_column(String(200))
    # Times a worker took the shard up; past Settings.max_attempts, the worker having died each time,
    # its job fails.
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    batches_done: Mapped[int] = mapped_column(Integer)  # batches in the checkpoint
    sentences_done: Mapped[int] = mapped_column(Integer)  # progress, also past the checkpoint
    tokens_done: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # first claimed
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class MinedLayerRow(Base):
    """One layer of a mining state (ffmem.engine.mining.mined_layer.MinedLayer as bytes), in one of two roles:
    a running shard's checkpoint (`shard` = the shard's index, ≥ 0), or the run's snapshot, the merge
    of its finished shards (`shard` = `SNAPSHOT`, −1: no shard has that index). The web reads both for
    provisional results while a run is mining; they are dropped once the run is stored."""

    __tablename__ = "mined_layers"

    SNAPSHOT: ClassVar[int] = -1  # the `shard` of a run's snapshot rows

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    shard: Mapped[int] = mapped_column(Integer, primary_key=True)  # a shard's index, or SNAPSHOT
    layer: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    data: Mapped[bytes] = deferred(mapped_column(LargeBinary, nullable=False))
