"""The job loop: what `ffmem worker` runs, and `ffmem index` / `ffmem analyze` in the foreground.

A `Worker` claims open shards and queued jobs (ffmem.store.jobs, ffmem.store.shards) and does each as a
step under its lease, which a heartbeat renews while the step runs (ffmem.worker.leases); a job's kind
says how (`handlers`): an index job is prepared or finished by its state (ffmem.worker.index: its
shards are mined apart, by any worker), an analysis computes the paper's analyses of a finished run
(ffmem.worker.analysis_jobs), a comparison two finished runs side by side (ffmem.worker.comparison).
A job's failure fails the job, never the worker. The worker holds one model (the process's, shared with
its live traces), loaded again only when a job names another.

`build_index` is `ffmem index` in the foreground: it queues the run's job (or finds the unfinished one
with the same spec, and resumes it) and works on it until it is done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from sqlalchemy.orm import sessionmaker

from ffmem.engine.errors import FfmemError
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.model.loading import shared_model
from ffmem.engine.relations.comparison import memory_weights
from ffmem.store import jobs, shards
from ffmem.store.jobs import Enqueued, JobKind, JobStatus, ShardStatus, StageProgress
from ffmem.store.models import Job, Run, Shard
from ffmem.store.specs import AnalysisSpec, RunSpec
from ffmem.worker.analysis_jobs import AnalysisOptions, analyze
from ffmem.worker.comparison import compare_runs
from ffmem.worker.composition import explanations_step, weight_graph_step
from ffmem.worker.explanations import ExplanationOptions
from ffmem.worker.index import IndexOptions, IndexPipeline, IndexSummary
from ffmem.worker.leases import Heartbeat, LostLease, Presence

log = logging.getLogger(__name__)

Handler = Callable[[Job, Heartbeat], None]  # does one step of a claimed job under its lease


def build_index(
    options: IndexOptions,
    sessions: sessionmaker,
    loaded: LoadedModel | None = None,
    again: bool = False,
    analysis: AnalysisSpec | None = None,
) -> IndexSummary:
    """Build (or resume) the index run `options.spec` in the foreground; returns what was stored.
    With `analysis`, then compute the paper's analyses of the run.

    When the same run is already built, returns it with `already_built` (unless `again`).
    """
    with sessions() as session:
        job, what, analysis_job = jobs.enqueue_run(
            session=session, spec=options.spec, again=again, analysis=analysis
        )
        session.commit()
        job_id, analysis_id = job.id, analysis_job.id if analysis_job else None
    worker = Worker(sessions, options, loaded=loaded)
    if what != Enqueued.done:
        worker.work(job_id=job_id)
    if analysis_id is not None:
        worker.work(job_id=analysis_id)
    return worker.index.summary(job_id, already_built=what == Enqueued.done)


@dataclass
class Worker:
    """Claims and does jobs until its job is done (`work(job_id)`) or, for `ffmem worker`, forever."""

    sessions: sessionmaker
    options: IndexOptions  # worker settings (device, cache, progress, lease); what to compute comes from jobs
    loaded: LoadedModel | None = None
    name: str = field(default_factory=jobs.worker_id)  # random per process: see ffmem.worker.leases
    presence: Presence = field(default_factory=Presence)
    index: IndexPipeline = field(init=False, repr=False)  # the index stages, and what they measured
    handlers: dict[JobKind, Handler] = field(init=False, repr=False)  # how a job of each kind is done
    _loaded_for: tuple | None = None  # (model, dtype) of `loaded`; None: as given

    def __post_init__(self) -> None:
        self.index = IndexPipeline(self.sessions, self.options, self.model, self.name)
        self.handlers = {
            JobKind.index: self.index_step,
            JobKind.analysis: self.analyze,
            JobKind.comparison: self.compare,
            JobKind.composition: self.compose,
        }

    # -- the loop ---------------------------------------------------------------------------------
    def work(self, job_id: int | None = None, poll_seconds: float = 1.0, once: bool = False) -> None:
        """Do work until job `job_id` is done or failed (or, without one and with `once`, until no job
        is queued or running)."""
        self.start()
        try:
            self._work(job_id, poll_seconds, once)
        finally:
            self.stop()

    def start(self) -> None:
        """Announce this worker (its presence file) and end the leases of workers known to be dead."""
        self.presence.announce(self.name)
        with self.sessions() as session:
            for holder in jobs.lease_holders(session=session):
                if holder != self.name and self.presence.is_dead(holder):
                    jobs.end_leases(session=session, worker=holder)
            session.commit()
        self.presence.sweep()  # the files of workers that died holding nothing

    def stop(self) -> None:
        """Give back what this worker holds (uncounted: it did not die) and withdraw its presence."""
        with self.sessions() as session:
            jobs.release_leases(session=session, worker=self.name)
            session.commit()
        self.presence.withdraw(self.name)

    def _work(self, job_id: int | None, poll_seconds: float, once: bool) -> None:
        while True:
            if job_id is not None:
                with self.sessions() as session:
                    job = session.get(Job, job_id)
                    if job.status == JobStatus.done:
                        return
                    if job.status == JobStatus.failed:
                        raise FfmemError(
                            f"{job.kind} job {job_id} failed: {job.error['type']}: {job.error['message']}"
                        )
            try:
                stepped = self.step(job_id)
            except Exception as error:
                if job_id is not None:
                    raise
                # Not a job's failure (those fail their job in `_guarded`): the queue itself, e.g. a
                # database that does not answer. A worker for all jobs waits and tries again.
                log.error("the worker's step failed: %s: %s; trying again", type(error).__name__, error)
                stepped = False
            if not stepped:
                if once and job_id is None and not self._jobs_in_progress():
                    return
                time.sleep(poll_seconds)

    def _jobs_in_progress(self) -> bool:
        """Whether any job is queued or running (maybe held by another worker: it may open shards)."""
        with self.sessions() as session:
            return jobs.in_progress(session=session)

    def step(self, job_id: int | None = None) -> bool:
        """One unit of work: mine an open shard, or do a job's next step. False when there is none."""
        reraise = job_id is not None  # a worker for all jobs outlives any one job's failure
        with self.sessions() as session:
            for job in jobs.open_jobs(session=session):
                if job_id is not None and job.id != job_id:
                    continue
                shard = shards.claim_shard(
                    session=session,
                    run_id=job.run_id,
                    worker=self.name,
                    lease=self.options.lease,
                    max_attempts=self.options.max_attempts,
                )
                session.commit()  # a shard given up on has failed its job
                if shard is not None:
                    mine = partial(self.index.mine_shard, job, shard)
                    self._guarded(job.id, mine, self._shard_lease(shard), reraise)
                    return True
            job = jobs.claim_job(
                session=session,
                worker=self.name,
                lease=self.options.lease,
                max_attempts=self.options.max_attempts,
                job_id=job_id,
            )
            session.commit()  # jobs given up on are failed
            if job is None:
                return False
        self._guarded(job.id, partial(self.handlers[job.kind], job), self._job_lease(job.id), reraise)
        return True

    def _guarded(
        self, job_id: int, action: Callable[[Heartbeat], None], lease: Heartbeat, reraise: bool
    ) -> None:
        """Run `action(lease)` while the heartbeat renews the lease; an error fails the job (stored with
        its traceback), never the worker: it is logged and the worker goes on to the next job, unless
        `reraise` (a caller waiting on this one job, as `ffmem index` does, gets the error itself). A
        lost lease is no error: the work is someone else's now. Interrupts leave everything to be resumed."""
        try:
            with lease:
                action(lease)
        except LostLease:
            return
        except Exception as error:
            with self.sessions() as session:
                jobs.fail_job(session=session, job_id=job_id, error=error)
                session.commit()
            if reraise:
                raise
            log.error(
                "job %s failed (its page: /jobs/%s): %s: %s", job_id, job_id, type(error).__name__, error
            )

    def _job_lease(self, job_id: int) -> Heartbeat:
        """The lease on job `job_id`, renewed every third of the lease."""

        def renew(session) -> bool:
            return jobs.hold_job(session=session, job_id=job_id, worker=self.name, lease=self.options.lease)

        return Heartbeat(renew, self.sessions, self.options.lease_seconds / 3, what=f"job {job_id}")

    def _shard_lease(self, shard: Shard) -> Heartbeat:
        """The lease on `shard`, renewed every third of the lease."""
        run_id, index = shard.run_id, shard.index

        def renew(session) -> bool:
            return shards.hold_shard(
                session=session, run_id=run_id, index=index, worker=self.name, lease=self.options.lease
            )

        what = f"shard {index} of run {run_id}"
        return Heartbeat(renew, self.sessions, self.options.lease_seconds / 3, what=what)

    # -- each kind of job -------------------------------------------------------------------------
    def index_step(self, job: Job, lease: Heartbeat) -> None:
        """An index job's step by its state: prepare its run; or, its shards all mined, finish it. One
        taken up again while its shards are open (a retry) is given back: the shards are every worker's."""
        if job.run_id is None:
            self.index.prepare(job, lease)
            return
        with self.sessions() as session:
            counts = shards.shard_counts(session=session, run_id=job.run_id)
            if counts[ShardStatus.pending] or counts[ShardStatus.running]:
                jobs.release_job(session=session, job_id=job.id)
                session.commit()
                return
        self.index.finish(job, lease)

    def analyze(self, job: Job, lease: Heartbeat) -> None:
        """The paper's analyses of the job's (finished) run, on the model that built it; progress is
        stored and the lease checked every few seconds."""
        loaded = self.model(self.run_spec(job.run_id))
        chosen = AnalysisOptions(job.spec, progress=self.options.progress)
        analyze(self.sessions, job.run_id, loaded, chosen, report=self._reporter(job.id, lease))
        self._finish_job(job.id, lease)

    def compare(self, job: Job, lease: Heartbeat) -> None:
        """Two finished runs side by side (ffmem.worker.comparison), each run's weights read from the
        model that built it, one model after the other."""
        a, b = job.spec.runs
        compare_runs(self.sessions, a, b, lambda run_id: memory_weights(self.model(self.run_spec(run_id))))
        self._finish_job(job.id, lease)

    def compose(self, job: Job, lease: Heartbeat) -> None:
        """The weight graph and the explanations of the job's finished run again, on the model that built
        it, as the job's spec says (ffmem.worker.composition); each step commits after the lease is
        checked."""
        loaded = self.model(self.run_spec(job.run_id))
        options = ExplanationOptions.of(job.spec, self.options)
        weight_graph_step(self.sessions, job.run_id, loaded, lease=lease)
        explanations_step(self.sessions, job.run_id, loaded, options, lease=lease)
        self._finish_job(job.id, lease)

    def _finish_job(self, job_id: int, lease: Heartbeat) -> None:
        with self.sessions() as session:
            lease.check(session)
            jobs.finish_job(session=session, job_id=job_id)
            session.commit()

    def _reporter(self, job_id: int, lease: Heartbeat, every: float = 2.0):
        """report(analysis, done, total) for `analyze`: checks the lease (LostLease when the job was
        taken over) and stores the progress at most every `every` seconds, and at each analysis's
        start and end."""
        last = {"at": float("-inf"), "stage": None}

        def report(stage: str, done: int, total: int) -> None:
            moment = time.monotonic()
            if moment - last["at"] < every and stage == last["stage"] and done < total:
                return
            last["at"], last["stage"] = moment, stage
            progress = StageProgress(stage=stage, done=done, total=total)
            with self.sessions() as session:
                lease.check(session)
                jobs.set_progress(session=session, job_id=job_id, worker=self.name, progress=progress)
                session.commit()

        return report

    # -- what a worker holds ----------------------------------------------------------------------
    def run_spec(self, run_id: int) -> RunSpec:
        """The spec that loads the model of run `run_id` as its index job loaded it (or by its source)."""
        with self.sessions() as session:
            built_by = jobs.built_by(session=session, run_id=run_id)
            source = session.get(Run, run_id).model.source
            return built_by.spec if built_by else self.options.spec.model_copy(update={"model": source})

    def model(self, spec: RunSpec) -> LoadedModel:
        """The run's model: the process's one copy (shared with its live traces), taken once per worker
        (again when a job names another)."""
        wanted = (spec.model, spec.dtype)
        if self.loaded is None or self._loaded_for not in (None, wanted):
            self.loaded = None  # ours goes first: no two models at once unless someone else holds it
            self.loaded = shared_model(
                spec.model, device=self.options.device, dtype=spec.dtype, cache_dir=self.options.cache_dir
            )
        self._loaded_for = wanted
        return self.loaded
