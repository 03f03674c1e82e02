"""Index runs as jobs: the queue's rules, failure and retry, a real SIGKILL mid-run, and two worker
processes sharing one Postgres — each ending exactly where an uninterrupted single worker ends."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta

import numpy as np
import pytest
from click.testing import Result
from sqlalchemy import make_url, select
from test_index import SENTENCES, options, stored_rows
from typer.testing import CliRunner

from ffmem.cli import cli as app
from ffmem.config import Settings, get_settings
from ffmem.store import jobs, models, shards
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.models import Job, Run, RunStatus, Shard
from ffmem.store.specs import RunSpec
from ffmem.worker.loop import build_index

FFMEM = [sys.executable, "-c", "from ffmem.cli import main; main()"]


@pytest.fixture
def big_corpus(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text("\n".join(SENTENCES * 60) + "\n")  # 420 sentences
    return path


def env_for(tmp_path, **settings) -> dict:
    env = dict(os.environ, FFMEM_CACHE_DIR=str(tmp_path / "cache"))
    defaults = {"batch_tokens": 64, "shard_sentences": 16, "top_k": 4, "value_tokens": 5, "dtype": "float32"}
    defaults["held_out_every"] = 0  # as tests/worker/test_index.options, the reference
    for name, value in (defaults | settings).items():
        env[f"FFMEM_{name.upper()}"] = str(value)
    return env


def cli(*args, env) -> Result:
    """`ffmem *args` with the environment `env`, in this process (typer's runner sets it around the call):
    the same command as a child's, without a second import of torch. It must succeed."""
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, list(args), env=env)
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    return result


def reference(tmp_path, tiny, tiny_model_dir, corpus, **changes):
    """The single-worker, uninterrupted result (SQLite, in process)."""
    url = f"sqlite:///{tmp_path / 'reference.db'}"
    upgrade(url)
    sessions = make_sessionmaker(make_engine(url))
    changes = {"batch_tokens": 64, "shard_sentences": 16, "device": "cpu"} | changes
    summary = build_index(options(tiny_model_dir, corpus, tmp_path, **changes), sessions, loaded=tiny)
    with sessions() as session:
        return stored_rows(session, summary.run_id)


def same_result(a: tuple, b: tuple) -> None:
    """Triggers, histograms, shares and values exactly (a share to float32's precision: Postgres stores the
    statistics as 4-byte reals, SQLite as 8); means up to rounding (any shard order: float64's last bits,
    which a 4-byte real may round either way)."""
    (triggers_a, stats_a, values_a), (triggers_b, stats_b, values_b) = a, b
    assert triggers_a == triggers_b and values_a == values_b
    assert [s[:3] for s in stats_a] == [s[:3] for s in stats_b]
    assert [np.float32(s[3]) for s in stats_a] == [np.float32(s[3]) for s in stats_b]
    assert [s[4] for s in stats_a] == pytest.approx([s[4] for s in stats_b], rel=2e-7, abs=1e-12)


def test_the_queue_reuses_unfinished_and_finished_jobs(db_url, tiny, tiny_model_dir, tmp_path):
    sessions = make_sessionmaker(make_engine(db_url))
    spec = options(tiny_model_dir, tmp_path / "c.txt", tmp_path).spec
    with sessions() as session:
        job, what = jobs.enqueue(session=session, spec=spec)
        assert what == "created" and job.status == "queued"
        again, what = jobs.enqueue(session=session, spec=RunSpec(**dict(reversed(spec.options().items()))))
        assert (again.id, what) == (job.id, "resumed")
        other, what = jobs.enqueue(session=session, spec=spec.model_copy(update={"top_k": 9}))
        assert what == "created" and other.id != job.id
        job.status = "done"
        assert jobs.enqueue(session=session, spec=spec)[1:] == ("done",)
        fresh, what = jobs.enqueue(session=session, spec=spec, again=True)
        assert what == "created" and fresh.id not in (job.id, other.id)


def test_a_failed_run_keeps_its_error_and_a_retry_finishes_it(
    db_url, tiny, tiny_model_dir, tmp_path, monkeypatch
):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES) + "\n")
    sessions = make_sessionmaker(make_engine(db_url))

    def broken(*args, **kwargs):
        raise ValueError("the device fell over")

    monkeypatch.setattr("ffmem.worker.index.mine_batches", broken)
    with pytest.raises(ValueError, match="fell over"):
        build_index(options(tiny_model_dir, corpus, tmp_path), sessions, loaded=tiny)
    with sessions() as session:
        job = session.scalars(select(Job)).one()
        assert job.status == "failed" and job.run.status == RunStatus.failed
        assert job.error["type"] == "ValueError" and job.error["message"] == "the device fell over"
        assert (
            "Traceback (most recent call last)" in job.error["traceback"]
            and "broken" in job.error["traceback"]
        )
        assert job.run.error == job.error
    monkeypatch.undo()
    summary = build_index(
        options(tiny_model_dir, corpus, tmp_path), sessions, loaded=tiny
    )  # the same command
    with sessions() as session:
        job = session.scalars(select(Job)).one()
        assert (job.status, job.error, job.run.status, summary.run_id) == ("done", None, "done", job.run_id)


@pytest.mark.slow
def test_sigkill_mid_run_then_the_same_command_resumes_it(tmp_path, tiny, tiny_model_dir, big_corpus):
    url = f"sqlite:///{tmp_path / 'killed.db'}"
    # 4 shards of ~32 batches: the kill must land while a shard is part-way, a window of ~30 batches
    env = env_for(tmp_path, checkpoint_batches=2, shard_sentences=128)
    command = [
        "index",
        "--model",
        str(tiny_model_dir),
        "--corpus",
        str(big_corpus),
        "--db",
        url,
        "--device",
        "cpu",
    ]
    process = subprocess.Popen(
        [*FFMEM, *command], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    engine = None
    deadline = time.monotonic() + 120
    try:
        while True:  # kill it once a shard is merged and another is part-way, past a checkpoint
            assert process.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
            if not (tmp_path / "killed.db").exists():
                continue
            engine = engine or make_engine(url)
            with make_sessionmaker(engine)() as session:
                try:
                    done = session.scalars(select(Shard).where(Shard.status == "done")).all()
                    running = session.scalars(select(Shard).where(Shard.status == "running")).all()
                except Exception:  # noqa: BLE001 - tables not created yet
                    continue
                if len(done) >= 1 and any(s.batches_done >= 2 for s in running):
                    break
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    with make_sessionmaker(engine)() as session:
        assert session.scalars(select(Job.status)).one() == "running"
        assert session.scalars(select(Run.status)).one() == "running"
    finished = cli(*command, env=env)
    assert "resumed 1 shard(s) from checkpoints" in finished.stdout, finished.stdout + finished.stderr
    with make_sessionmaker(engine)() as session:
        assert len(session.scalars(select(Run)).all()) == 1
        result = stored_rows(session, 1)
    engine.dispose()
    same_result(result, reference(tmp_path, tiny, tiny_model_dir, big_corpus, shard_sentences=128))
    again = cli(*command, env=env)
    assert "already indexes" in again.stdout and "--again" in again.stdout


@pytest.mark.slow
def test_two_workers_on_postgres_equal_one(postgres_url, tmp_path, tiny, tiny_model_dir, big_corpus):
    from conftest import _clean_postgres

    _clean_postgres(postgres_url)
    env = env_for(tmp_path)
    queued = cli(
        "index",
        "--queue",
        "--model",
        str(tiny_model_dir),
        "--corpus",
        str(big_corpus),
        "--db",
        postgres_url,
        env=env,
    )
    assert queued.stdout.startswith("job 1: queued"), queued.stdout
    workers = [
        subprocess.Popen(
            [*FFMEM, "worker", "--once", "--db", postgres_url, "--device", "cpu", "--poll", "0.2"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for worker in workers:
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, out + err
    engine = make_engine(postgres_url)
    with make_sessionmaker(engine)() as session:
        assert session.scalars(select(Job.status)).one() == "done"
        names = set(session.scalars(select(Shard.worker)))
        assert len(names) == 2, f"both workers mined shards: {names}"
        result = stored_rows(session, session.scalars(select(Run.id)).one())
    engine.dispose()
    same_result(result, reference(tmp_path, tiny, tiny_model_dir, big_corpus))


def test_sqlite_runs_one_worker(tmp_path, migrated_template, monkeypatch):
    url = f"sqlite:///{tmp_path / 'one.db'}"
    shutil.copyfile(make_url(migrated_template("sqlite")).database, tmp_path / "one.db")  # migrated
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    with sessions() as session:
        job, _ = jobs.enqueue(session=session, spec=RunSpec.from_settings(Settings(), model="x"))
        jobs.claim_job(
            session=session, worker="elsewhere:1:abc", lease=timedelta(seconds=600), max_attempts=3
        )
        session.commit()
    engine.dispose()
    # The command in this process (the refusal comes before any model is loaded), leaving its allocator
    # as it was: the worker's process-wide malloc settings are no part of the refusal.
    monkeypatch.setattr("ffmem.engine.allocator.keep_freed_memory", lambda: False)
    get_settings.cache_clear()
    try:
        refused = CliRunner().invoke(app, ["worker", "--once", "--db", url])
    finally:
        get_settings.cache_clear()
    assert refused.exit_code == 2, refused.output
    assert refused.stderr.strip() == (
        f"error: SQLite runs one worker at a time and elsewhere:1:abc is working on {url}; "
        "use Postgres (--db postgresql+psycopg://…) for several workers"
    )


def test_a_lapsed_lease_passes_the_shard_to_another_worker(db_url, tiny, tiny_model_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES * 4) + "\n")
    sessions = make_sessionmaker(make_engine(db_url))
    chosen = options(tiny_model_dir, corpus, tmp_path)
    with sessions() as session:
        job, _ = jobs.enqueue(session=session, spec=chosen.spec)
        session.commit()
    first = jobs_worker(sessions, chosen, tiny, "host-a:1:aaaaaa")
    assert first.step()  # prepares the run
    short = timedelta(milliseconds=50)
    with sessions() as session:
        run_id = session.get(Job, job.id).run_id
        taken = shards.claim_shard(
            session=session, run_id=run_id, worker=first.name, lease=short, max_attempts=3
        )
        session.commit()
        assert taken.index == 0
    with sessions() as session:  # while the lease holds, another worker gets the next shard
        assert (
            shards.claim_shard(
                session=session, run_id=run_id, worker="host-b:2:bbbbbb", lease=short, max_attempts=3
            ).index
            == 1
        )
    time.sleep(0.1)  # the first worker stalls past its lease
    with sessions() as session:
        again = shards.claim_shard(
            session=session,
            run_id=run_id,
            worker="host-b:2:bbbbbb",
            lease=timedelta(minutes=5),
            max_attempts=3,
        )
        session.commit()
        assert (again.index, again.worker) == (0, "host-b:2:bbbbbb")
        lost = shards.checkpoint_shard(
            session=session,
            shard=taken,
            worker=first.name,
            lease=short,
            batches_done=1,
            sentences_done=1,
            tokens_done=1,
            layers=None,
        )
        assert lost is False  # the stalled worker learns it lost the shard and stops


def jobs_worker(sessions, chosen, tiny, name):
    from ffmem.worker.loop import Worker

    return Worker(sessions, chosen, loaded=tiny, name=name)


LEASE = 1.2  # seconds


def test_a_prepare_longer_than_the_lease_keeps_its_job(db_url, tiny, tiny_model_dir, tmp_path):
    """The heartbeat renews the lease (1.2 s: a beat each 0.4 s) while a prepare runs three times as long:
    nobody can take the job meanwhile; once the beats stop, the lease runs out and another worker may."""
    sessions = make_sessionmaker(make_engine(db_url))
    chosen = options(tiny_model_dir, tmp_path / "c.txt", tmp_path, lease_seconds=LEASE)
    with sessions() as session:
        job, _ = jobs.enqueue(session=session, spec=chosen.spec)
        session.commit()
    worker = jobs_worker(sessions, chosen, tiny, "host-a:1:" + "a" * 32)
    tries = []

    def slow_prepare(claimed, lease) -> None:
        deadline = time.monotonic() + 3 * LEASE
        while time.monotonic() < deadline:  # another worker keeps trying to take the job
            with sessions() as session:
                taken = jobs.claim_job(
                    session=session, worker="other", lease=timedelta(minutes=5), max_attempts=9
                )
                tries.append(None if taken is None else taken.worker)
                session.rollback()
            time.sleep(0.1)

    worker.index.prepare = slow_prepare
    assert worker.step()
    assert len(tries) >= 10 and set(tries) == {None}
    with sessions() as session:
        held = session.get(Job, job.id)
        assert (held.status, held.worker, held.attempts) == ("running", worker.name, 1)
    time.sleep(LEASE + 0.2)  # no heartbeat now: the lease runs out
    with sessions() as session:
        taken = jobs.claim_job(session=session, worker="other", lease=timedelta(minutes=5), max_attempts=9)
        assert (taken.id, taken.worker, taken.attempts) == (job.id, "other", 2)


def test_two_workers_with_one_hostname_and_pid_keep_their_leases(
    db_url, tiny_model_dir, tmp_path, monkeypatch
):
    """Containers share host names and PIDs (here both "worker" and 7): the ids differ by their uuid, and a
    worker starting or stopping ends only its own leases and those of workers it knows are dead."""
    from ffmem.worker.leases import Presence
    from ffmem.worker.loop import Worker

    monkeypatch.setattr(jobs.socket, "gethostname", lambda: "worker")
    monkeypatch.setattr(jobs.os, "getpid", lambda: 7)
    sessions = make_sessionmaker(make_engine(db_url))
    chosen = options(tiny_model_dir, tmp_path / "c.txt", tmp_path)
    a = Worker(sessions, chosen, presence=Presence(tmp_path / "container-a"))
    b = Worker(sessions, chosen, presence=Presence(tmp_path / "container-b"))
    assert a.name.startswith("worker:7:") and b.name.startswith("worker:7:") and a.name != b.name
    a.start()
    with sessions() as session:
        job, _ = jobs.enqueue(session=session, spec=chosen.spec)
        jobs.claim_job(session=session, worker=a.name, lease=timedelta(minutes=5), max_attempts=3)
        session.commit()

    def holder() -> tuple[str | None, bool]:
        with sessions() as session:
            row = session.get(Job, job.id)
            lease = (
                row.lease_until
                if row.lease_until.tzinfo
                else row.lease_until.replace(tzinfo=models.now().tzinfo)
            )
            return row.worker, lease > models.now()

    b.start()  # in another container: a's presence file is not there, so a may be alive
    b.stop()
    assert holder() == (a.name, True)
    with sessions() as session:
        assert (
            jobs.claim_job(session=session, worker=b.name, lease=timedelta(minutes=5), max_attempts=3) is None
        )
    # In a's own container a third worker sees a alive (its lock is held) and leaves its lease alone …
    c = Worker(sessions, chosen, presence=Presence(tmp_path / "container-a"))
    c.start()
    c.stop()
    assert holder() == (a.name, True)
    # … until a's process dies (the kernel drops its lock; its file stays): then it ends a's lease at once,
    # and drops a's file, as it drops those of workers that died holding nothing.
    os.close(a.presence._held.pop(a.name))
    (tmp_path / "container-a" / ("d" * 32 + ".lock")).touch()
    c.start()
    assert holder() == (a.name, False)
    assert [path.name for path in (tmp_path / "container-a").iterdir()] == [c.name[-32:] + ".lock"]
    with sessions() as session:
        taken = jobs.claim_job(session=session, worker=c.name, lease=timedelta(minutes=5), max_attempts=3)
        assert (taken.id, taken.attempts) == (job.id, 2)
        session.commit()
    c.stop()
