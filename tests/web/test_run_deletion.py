"""Deleting an index run (a write: ffmem/web/access.py guards it) takes its rows and its jobs, not its labels;
a run being built cannot be deleted. (Its own module: it rebuilds the database, the explorer index is
module-wide.)"""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import func, select

from ffmem.config import Settings
from ffmem.store import jobs, models
from ffmem.store.models import Job, Run, RunStatus
from ffmem.store.specs import AnalysisSpec
from ffmem.web.main import create_app


def test_deleting_a_run_takes_its_rows_and_jobs(db_url, tiny, tiny_model_dir, tmp_path):
    from sqlalchemy import update

    from bench.tiny_tokenizer import TRAINING_TEXT
    from ffmem.store.db import make_engine, make_sessionmaker
    from ffmem.store.models import KeyExamples, KeyStats, LanguageModel, MemoryList, ValueHistogram
    from ffmem.worker.index import IndexOptions
    from ffmem.worker.loop import build_index

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TRAINING_TEXT) + "\n")
    settings = Settings(
        model=str(tiny_model_dir), corpus=str(corpus), sentences=None, top_k=3, device="cpu", dtype="float32",
        batch_tokens=128, shard_sentences=8, value_tokens=4, cache_dir=tmp_path / "cache",
    )  # fmt: skip
    options = IndexOptions.from_settings(settings, progress=False)
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    run_id = build_index(options, sessions, loaded=tiny).run_id
    app = create_app(Settings(database_url=db_url))
    with sessions() as session, TestClient(app) as client:
        slug = session.scalars(select(LanguageModel.slug)).one()
        session.execute(update(Run).where(Run.id == run_id).values(status=RunStatus.running))
        session.commit()
        busy = client.post(f"/m/{slug}/runs/{run_id}/delete.json")
        assert (busy.status_code, busy.json()["error"]) == (
            409, f"Run {run_id} is being built; delete it once it is done or failed."
        )  # fmt: skip
        session.execute(update(Run).where(Run.id == run_id).values(status=RunStatus.done))
        # Its analyses: one queued for it, one still waiting for its index job (as if queued with it).
        spec = AnalysisSpec(examples=5, keys=2, triggers=2, seed=0)
        jobs.enqueue_analysis(session=session, spec=spec, run_id=run_id)
        builder = session.scalars(select(Job.id).where(Job.kind == "index")).one()
        waiting = Job(kind="analysis", status="queued", options={"examples": 6}, after_job_id=builder,
                      fingerprint="w", attempts=0, created_at=models.now())  # fmt: skip
        session.add(waiting)
        session.commit()
        assert session.scalar(select(func.count()).select_from(Job)) == 3
        answer = client.post(f"/m/{slug}/runs/{run_id}/delete.json")
        assert answer.status_code == 200
        assert [m["runs"] for m in answer.json()["models"]] == [[]] and answer.json()["jobs"] == []
        for table in (Run, MemoryList, KeyStats, KeyExamples, ValueHistogram, Job):
            assert session.scalar(select(func.count()).select_from(table)) == 0, table.__name__
        again = client.post(f"/m/{slug}/runs/{run_id}/delete.json")
        assert (again.status_code, again.json()["error"]) == (404, f"Model {slug!r} has no run {run_id}.")
        assert client.post(f"/m/{slug}/runs/{run_id}/delete", follow_redirects=False).status_code == 404
    app.state.engine.dispose()
    engine.dispose()
