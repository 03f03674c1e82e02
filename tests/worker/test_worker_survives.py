"""A job's failure fails the job, never the worker: `ffmem worker` (what `ffmem serve` and `ffmem demo`
start) meets a job whose model cannot load, stores its error, claims the next job and keeps answering
live traces."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from explorer_index import EXPLORER_SENTENCES
from sqlalchemy import select

from ffmem.config import Settings
from ffmem.store import jobs
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.models import Job
from ffmem.store.specs import RunSpec


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait(condition, seconds: float, what: str, worker: subprocess.Popen):
    deadline = time.monotonic() + seconds
    while not (answer := condition()):
        assert worker.poll() is None, f"the worker exited: {worker.stdout.read()}"
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return answer


@pytest.mark.slow
def test_a_worker_outlives_a_job_with_an_unloadable_model(tmp_path, tiny_model_dir):
    url = f"sqlite:///{tmp_path / 'w.db'}"
    upgrade(url)
    sessions = make_sessionmaker(make_engine(url))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(EXPLORER_SENTENCES) + "\n")
    settings = Settings(corpus=str(corpus), sentences=len(EXPLORER_SENTENCES), top_k=4, shard_sentences=8)
    missing = tmp_path / "no-such-model"  # a folder without a config.json: the load fails at once
    missing.mkdir()
    with sessions() as session:
        bad, _ = jobs.enqueue(session=session, spec=RunSpec.from_settings(settings, model=str(missing)))
        session.commit()
        bad_id = bad.id

    port = _free_port()
    command = [sys.executable, "-c", "from ffmem.cli import main; main()", "worker", "--db", url]
    command += ["--device", "cpu", "--poll", "0.2", "--port", str(port), "--preload", str(tiny_model_dir)]
    env = dict(os.environ, FFMEM_CACHE_DIR=str(tmp_path / "cache"))
    worker = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"

    def status(job_id: int) -> str:
        with sessions() as session:
            return session.get(Job, job_id).status

    try:
        _wait(lambda: status(bad_id) == "failed", 60, "the bad job did not fail", worker)
        with sessions() as session:
            error = session.get(Job, bad_id).error
        assert error["type"] == "ModelLoadError" and str(missing) in error["message"]
        # The same worker claims the next job and builds it ...
        with sessions() as session:
            good, _ = jobs.enqueue(
                session=session, spec=RunSpec.from_settings(settings, model=str(tiny_model_dir))
            )
            session.commit()
            good_id = good.id
        _wait(lambda: status(good_id) == "done", 120, "the next job was not built", worker)
        # ... and answers live traces all along.
        answer = httpx.post(
            f"{base}/trace", json={"model": str(tiny_model_dir), "text": "Paris", "memories": 2}
        )
        assert answer.status_code == 200 and len(answer.json()["layers"]) == 3
        # Queued again, the bad job fails again; the worker still stands.
        with sessions() as session:
            again, what = jobs.enqueue(
                session=session, spec=RunSpec.from_settings(settings, model=str(missing))
            )
            session.commit()
            assert (again.id, what) == (bad_id, "resumed")
        _wait(lambda: status(bad_id) == "failed", 60, "the bad job did not fail again", worker)
        assert httpx.get(f"{base}/health", timeout=5).json()["status"] == "ready"
        assert worker.poll() is None
        with sessions() as session:
            statuses = session.scalars(select(Job.status).order_by(Job.id)).all()
        assert statuses == ["failed", "done"]
    finally:
        worker.send_signal(signal.SIGTERM)
        output = worker.communicate(timeout=30)[0]
    assert f"job {bad_id} failed (its page: /jobs/{bad_id}): ModelLoadError" in output


def test_serve_starts_its_local_worker_again_when_it_exits(tmp_path):
    from ffmem.cli.serve import _LocalWorker

    starts = tmp_path / "starts"
    script = f"open({str(starts)!r}, 'a').write('x'); raise SystemExit(3)"
    local = _LocalWorker([sys.executable, "-c", script], pause=0.1)
    try:
        deadline = time.monotonic() + 30
        while not starts.exists() or len(starts.read_text()) < 3:
            assert time.monotonic() < deadline, "the local worker was not started again"
            time.sleep(0.1)
    finally:
        local.stop()
    count = len(starts.read_text())
    time.sleep(0.5)
    assert len(starts.read_text()) == count  # stopped: not started again
