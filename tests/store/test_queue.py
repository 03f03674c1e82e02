"""The job queue's rules (ffmem/store/jobs.py), on SQLite and Postgres: one unfinished job per fingerprint
even when two callers race, a step whose worker keeps dying fails with the reason after max_attempts,
a worker stopping cleanly gives its step back uncounted, and an analysis waits for its index job by a
foreign key."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from ffmem.config import Settings
from ffmem.store import corpora, jobs, models, runs, shards
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.jobs import Enqueued, JobKind, JobStatus, ShardStatus
from ffmem.store.models import Analysis, Job, Run, RunStatus, Shard
from ffmem.store.specs import AnalysisSpec, RunSpec

SPEC = RunSpec.from_settings(Settings(_env_file=None), model="tiny", corpus="c.txt", sentences=10)
LEASE = timedelta(milliseconds=50)  # a worker that dies holds its step this long


@pytest.fixture
def sessions(db_url):
    engine = make_engine(db_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def died() -> None:
    """The worker holding a step is gone: wait its lease out."""
    time.sleep(2 * LEASE.total_seconds())


def test_two_enqueues_at_once_make_one_job(sessions, monkeypatch):
    """Both look, find nothing, and insert: the partial unique index lets one in, the other gets its job."""
    looked = threading.Barrier(2, timeout=10)
    first_look = jobs._active_job

    def look_then_wait(session, key):
        found = first_look(session, key)
        if not getattr(local, "looked", False):  # each caller's first look: both see no job
            local.looked = True
            looked.wait()
        return found

    local = threading.local()
    monkeypatch.setattr(jobs, "_active_job", look_then_wait)
    results, errors = [], []

    def enqueue() -> None:
        try:
            with sessions() as session:
                job, what = jobs.enqueue(session=session, spec=SPEC)
                session.commit()
                results.append((job.id, what))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    callers = [threading.Thread(target=enqueue) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=30)
    assert errors == []
    assert sorted(what for _, what in results) == [Enqueued.created, Enqueued.resumed]
    assert len({job_id for job_id, _ in results}) == 1
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 1


def test_the_database_refuses_a_second_unfinished_job_with_one_fingerprint(sessions):
    def row(status: JobStatus) -> Job:
        key = jobs.job_fingerprint(SPEC)
        return Job(
            kind=JobKind.index,
            status=status,
            options=SPEC.options(),
            fingerprint=key,
            attempts=0,
            created_at=models.now(),
        )

    with sessions() as session:
        session.add_all([row(JobStatus.done), row(JobStatus.failed), row(JobStatus.queued)])
        session.commit()  # finished ones share it freely
        session.add(row(JobStatus.running))
        with pytest.raises(IntegrityError):
            session.commit()


def test_a_job_whose_worker_dies_each_time_fails_after_max_attempts(sessions):
    with sessions() as session:
        job, _ = jobs.enqueue(session=session, spec=SPEC)
        session.commit()
    for attempt in (1, 2, 3):  # each worker takes the job up and dies (its lease runs out)
        with sessions() as session:
            claimed = jobs.claim_job(session=session, worker=f"w{attempt}", lease=LEASE, max_attempts=3)
            session.commit()
            assert (claimed.id, claimed.attempts, claimed.worker) == (job.id, attempt, f"w{attempt}")
        died()
    with sessions() as session:
        assert jobs.claim_job(session=session, worker="w4", lease=LEASE, max_attempts=3) is None
        session.commit()
        failed = session.get(Job, job.id)
        assert (failed.status, failed.worker, failed.error["type"]) == (
            JobStatus.failed,
            None,
            "TooManyAttempts",
        )
        assert failed.error["message"] == (
            "failed after 3 attempts: the worker died each time while preparing the run (its lease of "
            "0.05 s ran out before it finished; the last was w3). It may have been killed for memory (see "
            "the kernel log) or stopped: fix the cause and retry the job; FFMEM_MAX_ATTEMPTS sets how many "
            "attempts a step gets"
        )
        # A retry counts from 0 again.
        assert jobs.retry(session=session, job_id=job.id).id == job.id
        session.commit()
        assert jobs.claim_job(session=session, worker="w5", lease=LEASE, max_attempts=3).attempts == 1


def test_a_worker_that_stops_cleanly_gives_its_step_back_uncounted(sessions):
    with sessions() as session:
        job, _ = jobs.enqueue(session=session, spec=SPEC)
        session.commit()
    for _ in range(5):  # Ctrl-C five times: no attempt is lost
        with sessions() as session:
            claimed = jobs.claim_job(session=session, worker="w", lease=timedelta(minutes=5), max_attempts=1)
            assert (claimed.id, claimed.attempts) == (job.id, 1)
            jobs.release_leases(session=session, worker="w")
            session.commit()
    with sessions() as session:
        given_back = session.get(Job, job.id)
        assert (given_back.status, given_back.worker, given_back.lease_until, given_back.attempts) == (
            JobStatus.running, None, None, 0,
        )  # fmt: skip


def test_a_step_that_ended_does_not_count_against_the_next(sessions):
    """Preparing took two attempts; finishing the run (after its shards) has its own."""
    run_id = _run(sessions)
    with sessions() as session:
        job, _ = jobs.enqueue(session=session, spec=SPEC)
        session.commit()
    for attempt in (1, 2):
        with sessions() as session:
            assert (
                jobs.claim_job(session=session, worker="w", lease=LEASE, max_attempts=2).attempts == attempt
            )
            session.commit()
        died()
    with sessions() as session:  # the second attempt prepared it: its shards are open, nobody holds it
        session.get(Job, job.id).run_id = run_id
        jobs.release_job(session=session, job_id=job.id)
        session.commit()
        finisher = jobs.claim_job(session=session, worker="f", lease=LEASE, max_attempts=2)
        assert (finisher.id, finisher.attempts) == (job.id, 1)


def test_a_shard_whose_worker_dies_each_time_fails_its_job(sessions):
    run_id = _run(sessions)
    with sessions() as session:
        job, _ = jobs.enqueue(session=session, spec=SPEC)
        jobs.claim_job(session=session, worker="w", lease=LEASE, max_attempts=2)
        session.get(Job, job.id).run_id = run_id
        shards.create_shards(session=session, run_id=run_id, n_sentences=10, shard_sentences=5)
        jobs.release_job(session=session, job_id=job.id)
        session.commit()
    for attempt in (1, 2):
        with sessions() as session:
            shard = shards.claim_shard(
                session=session, run_id=run_id, worker=f"m{attempt}", lease=LEASE, max_attempts=2
            )
            session.commit()
            assert (shard.index, shard.attempts) == (0, attempt)
        died()
    with sessions() as session:
        assert (
            shards.claim_shard(session=session, run_id=run_id, worker="m3", lease=LEASE, max_attempts=2)
            is None
        )
        session.commit()
        failed = session.get(Job, job.id)
        assert failed.status == JobStatus.failed and failed.run.status == RunStatus.failed
        assert failed.error["message"].startswith(
            "failed after 2 attempts: the worker died each time while mining shard 0 (its lease of "
            "0.05 s ran out before it finished; the last was m2)."
        )
        jobs.retry(session=session, job_id=job.id)
        session.commit()
        assert session.scalars(select(Shard.attempts).order_by(Shard.index)).all() == [0, 0]
        again = shards.claim_shard(session=session, run_id=run_id, worker="m4", lease=LEASE, max_attempts=2)
        assert (again.index, again.status, again.attempts) == (0, ShardStatus.running, 1)


def test_an_analysis_waits_for_its_index_job_by_a_foreign_key(sessions):
    run_id = _run(sessions)
    analysis = AnalysisSpec(examples=5, keys=2, triggers=2, seed=0)
    with sessions() as session:
        index_job, _ = jobs.enqueue(session=session, spec=SPEC)
        waiting, what = jobs.enqueue_analysis(session=session, spec=analysis, after=index_job.id)
        twin, again = jobs.enqueue_analysis(session=session, spec=analysis, after=index_job.id)
        session.commit()
        assert (what, again, twin.id) == (Enqueued.created, Enqueued.resumed, waiting.id)
        assert (waiting.after_job_id, waiting.run_id, waiting.spec) == (index_job.id, None, analysis)
        # The index job builds run `run_id` and is done: the analysis gets the run, and the fingerprint of
        # one queued for that run, so queuing it for the run now finds it.
        index_job.run_id, index_job.status = run_id, JobStatus.done
        assert jobs.attach_analyses(session=session, index_job=index_job) == 1
        session.commit()
        assert (waiting.run_id, waiting.after_job_id) == (run_id, index_job.id)
        session.get(Job, index_job.id).run.status = RunStatus.done
        found, what = jobs.enqueue_analysis(session=session, spec=analysis, run_id=run_id)
        assert (found.id, what) == (waiting.id, Enqueued.resumed)
        assert [job.id for job in jobs.analysis_jobs(session=session, run_id=run_id)] == [waiting.id]
        # Deleting the run takes its index job and the analyses waiting for it.
        runs.delete_run(session=session, run_id=run_id)
        session.commit()
        assert session.scalar(select(func.count()).select_from(Job)) == 0


def test_a_run_and_its_analyses_are_queued_in_one_call(sessions):
    """`ffmem index --analyze`, the home page's form and `ffmem demo` queue a run and its analyses with
    `enqueue_run`: the analyses wait for the index job; once the run is built and analyzed, the demo's
    (`keep_analyses`) queues none, the others queue theirs for the run."""
    run_id = _run(sessions)
    analysis, smaller = (AnalysisSpec(examples=n, keys=2, triggers=2, seed=0) for n in (5, 3))
    with sessions() as session:
        job, what, waiting = jobs.enqueue_run(session=session, spec=SPEC, analysis=analysis)
        assert (what, waiting.after_job_id, waiting.run_id, waiting.spec) == (
            Enqueued.created,
            job.id,
            None,
            analysis,
        )
        job.run_id, job.status, waiting.status = run_id, JobStatus.done, JobStatus.done
        session.get(Run, run_id).status = RunStatus.done
        session.add(
            Analysis(
                run_id=run_id, name="agreement", options={}, data={}, seconds=0.0, created_at=models.now()
            )
        )
        session.flush()
        same, what, none = jobs.enqueue_run(session=session, spec=SPEC, analysis=smaller, keep_analyses=True)
        assert (same.id, what, none) == (job.id, Enqueued.done, None)
        same, what, queued = jobs.enqueue_run(session=session, spec=SPEC, analysis=smaller)
        assert (same.id, what, queued.run_id, queued.after_job_id, queued.spec) == (
            job.id, Enqueued.done, run_id, None, smaller
        )  # fmt: skip


def _run(sessions) -> int:
    """A run row (of a model and a corpus) for jobs and shards to point at."""
    with sessions() as session:
        model = runs.upsert_model(
            session=session, slug="tiny", source="tiny", revision=None, architecture="LlamaForCausalLM",
            family="llama", n_layers=1, n_keys=4, d_model=2, vocab_size=8, activation="silu", gated=True,
        )  # fmt: skip
        corpus = corpora.store_corpus(
            session=session, name="c", source="c.txt", source_sha256="0" * 64, fingerprint="f" * 64,
            tokenizer="tiny", max_tokens=8, skipped={}, sentences=[("a b", [1, 2], [(0, 1), (2, 3)], 0)] * 10,
        )  # fmt: skip
        run = runs.create_run(
            session=session, model_id=model.id, corpus_id=corpus.id, top_k=2, n_value_tokens=2,
            n_sentences=10, dtype="float32", device="cpu", package_version="0", provenance={},
            histogram_edges=[0.0, 1.0],
        )  # fmt: skip
        session.commit()
        return run.id
