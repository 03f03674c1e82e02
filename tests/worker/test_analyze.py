"""`ffmem analyze` on a tiny index whose corpus holds more sentences than the run mined: every stored
number equals ffmem.engine.paper.analyses on the same held-out prefixes and trigger prefixes, or a direct
count."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from sqlalchemy import func, select

from bench.tiny_tokenizer import TRAINING_TEXT
from ffmem.config import Settings
from ffmem.engine.mining.corpus import tokenize
from ffmem.engine.paper.analyses import census, token_removal
from ffmem.store import corpora, memory_reads
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import Analysis, Job, KeyStats, Run
from ffmem.store.specs import AnalysisSpec
from ffmem.worker.analysis_jobs import value_top_tokens
from ffmem.worker.index import IndexOptions
from ffmem.worker.loop import build_index

MORE = ["The river flows into the sea.", "Rome was not built in a day.", "Light travels faster than sound."]


@pytest.fixture
def analyzed(db_url, tiny, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TRAINING_TEXT + MORE) + "\n")
    settings = Settings(
        model="tiny", corpus=str(corpus), sentences=len(TRAINING_TEXT), top_k=4, device="cpu",
        dtype="float32", batch_tokens=128, shard_sentences=8, value_tokens=5, cache_dir=tmp_path / "cache",
    )  # fmt: skip
    options = IndexOptions.from_settings(settings, progress=False)
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    # The index run and then its analyses, as jobs (`ffmem index --analyze`): the analysis job waits
    # for the run, gets it when the run is done, and the same worker computes it.
    analysis = AnalysisSpec(examples=10, keys=3, triggers=2, seed=0)
    summary = build_index(options, sessions, loaded=tiny, analysis=analysis)
    with sessions() as session:
        job = session.scalars(select(Job).where(Job.kind == "analysis")).one()
        index_job = session.scalars(select(Job.id).where(Job.kind == "index")).one()
        assert (job.status, job.run_id, job.after_job_id, job.options) == (
            "done",
            summary.run_id,
            index_job,
            analysis.options(),
        )
        # The last report: token removal's last batch (one batch a layer here).
        assert job.progress == {"stage": "token_removal", "done": 3, "total": 3}
        stored = session.execute(
            select(Analysis.name, Analysis.seconds).where(Analysis.run_id == summary.run_id)
        )
        seconds = dict(stored.all())
    yield sessions, summary.run_id, seconds
    engine.dispose()


def test_stored_analyses_equal_the_engine(analyzed, tiny):
    sessions, run_id, seconds = analyzed
    assert set(seconds) == {
        "agreement", "census", "token_removal", "weight_graph", "explanations", "token_change",
    }  # fmt: skip
    with sessions() as session:
        stored = {a.name: a for a in session.scalars(select(Analysis).where(Analysis.run_id == run_id))}
        run = session.get(Run, run_id)
        # Figs. 4–5: rank 0 is agreement.
        ranks = {}
        for stats in session.scalars(select(KeyStats).where(KeyStats.run_id == run_id)):
            if stats.next_token_rank is not None and stats.next_token_rank >= 0:
                ranks.setdefault(stats.layer, []).append(stats.next_token_rank)
        agreement = stored["agreement"].data
        assert agreement["agreement"] == [
            pytest.approx(np.mean(np.array(ranks[layer]) == 0)) for layer in range(3)
        ]
        assert agreement["baseline"] == pytest.approx(1 / run.model.vocab_size)
        # Figs. 7–11: the three held-out sentences, one random prefix each (seed 0).
        held_out = tokenize(MORE, tiny.tokenizer, run.corpus.max_tokens)
        rng = random.Random(0)
        prefixes = [s.token_ids[: rng.randrange(s.first_position, len(s.token_ids)) + 1] for s in held_out]
        value_top = value_top_tokens(session, run_id, 3)  # [layers, 2, d_ff], as stored
        expected = census(tiny, prefixes, torch.from_numpy(value_top), set(), batch=1)
        data = stored["census"].data
        assert data["examples"] == 3
        for field in ("positive", "active", "no_memory_agrees", "settled", "final_prob"):
            assert data[field] == pytest.approx(getattr(expected, field), rel=1e-4, abs=1e-6), field
        assert data["cases"] == {case: pytest.approx(v) for case, v in expected.cases.items()}
        # Fig. 3: the sampled keys' top-2 trigger prefixes.
        removal = stored["token_removal"].data
        rng = random.Random(0)
        items, owners = [], []
        for layer in range(3):
            for key in sorted(rng.sample(range(48), 3)):
                for trigger in memory_reads.get_triggers(
                    session=session, run_id=run_id, layer=layer, key=key, sign=1, limit=2
                ):
                    sentence = corpora.get_sentences(
                        session=session, corpus_id=run.corpus_id, indices=[trigger.sentence_index]
                    )[trigger.sentence_index]
                    items.append((layer, key, sentence.token_ids[: trigger.position + 1]))
                    owners.append(f"{layer}/{key}")
        first, last = token_removal(tiny, items)
        assert removal["prefixes"] == len(items) == 3 * 3 * 2
        for owner in set(owners):
            layer, key = (int(part) for part in owner.split("/"))
            lasts = [x for o, x in zip(owners, last, strict=True) if o == owner and x is not None]
            firsts = [x for o, x in zip(owners, first, strict=True) if o == owner and x is not None]
            stats = session.get(KeyStats, (run_id, layer, key))
            assert stats.last_token_change == (_close(np.mean(lasts)) if lasts else None)
            assert stats.first_token_change == (_close(np.mean(firsts)) if firsts else None)
            assert stats.shallowness == (_close(float(np.clip(-np.mean(lasts), 0, 1))) if lasts else None)
        with_score = session.scalar(
            select(func.count())
            .select_from(KeyStats)
            .where(KeyStats.run_id == run_id, KeyStats.shallowness.isnot(None))
        )
        assert with_score <= len(set(owners))  # only sampled keys have one


def _close(value):
    return pytest.approx(value, rel=1e-4, abs=1e-6)  # batches of another shape: float32 last bits


def test_the_analysis_page_shows_what_is_stored(analyzed, db_url):
    from fastapi.testclient import TestClient

    from ffmem.web.main import create_app

    sessions, run_id, _ = analyzed
    with sessions() as session:
        rows = {a.name: a for a in session.scalars(select(Analysis).where(Analysis.run_id == run_id))}
        stored = {name: a.data for name, a in rows.items()}
        slug = session.get(Run, run_id).model.slug
    app = create_app(Settings(database_url=db_url))
    with TestClient(app) as client:
        body = client.get(f"/m/{slug}/analysis.json").json()
        assert body["missing"] == [] and {"agreement", "census", "token_removal"} <= set(body["computed"])
        figures = {f["name"]: f for f in body["figures"]}
        assert list(figures) == ["fig3", "fig4", "fig5", "fig7", "fig8", "fig9", "fig10", "fig11"]
        assert figures["fig3"]["series"]["last token removed"] == stored["token_removal"]["last"]
        assert figures["fig4"]["series"]["agreement rate"] == stored["agreement"]["agreement"]
        assert figures["fig7"]["series"]["m > 0"] == [v / 48 for v in stored["census"]["positive"]]
        assert figures["fig11"]["series"] == stored["census"]["cases"]
        assert figures["fig9"]["depth"] == [0.0, 0.5, 1.0] and figures["fig8"]["paper"]
        page = client.get(f"/m/{slug}/analysis").text
        assert all(f'id="chart-{name}"' in page for name in figures) and 'id="analysis-missing"' not in page
        said = {  # issue 39: how each was computed, in words (its options as the job recorded them)
            "agreement": "Agreement (Figs. 4–5): read off the index, each key's top trigger and its value",
            "census": "Census (Figs. 7–11): over 10 held-out prefixes, one random position of each held-out "
            "sentence (seed 0)",
            "token_removal": "Token removal (Fig. 3): 3 sampled keys a layer and their top 2 trigger "
            "prefixes (seed 0)",
        }
        for name, words in said.items():
            row = rows[name]
            text = f"{words}; computed in {row.seconds:.1f} s on {row.created_at:%Y-%m-%d %H:%M} UTC."
            assert body["computed"][name]["text"] == text
            assert f"<p>{text}</p>" in page.replace("&#39;", "'")
        assert "<dt>" not in page.split('id="analysis-provenance"')[1]  # no field dump
        with sessions() as session:
            sampled = session.scalars(
                select(KeyStats).where(KeyStats.run_id == run_id, KeyStats.shallowness.isnot(None)).limit(1)
            ).one()
        stats = client.get(f"/m/{slug}/layers/{sampled.layer}/keys/{sampled.key}.json").json()["stats"]
        assert (stats["shallowness"], stats["last_token_change"]) == (
            sampled.shallowness,
            sampled.last_token_change,
        )
        assert 'id="shallowness"' in client.get(f"/m/{slug}/layers/{sampled.layer}/keys/{sampled.key}").text
    app.state.engine.dispose()


def _tiny_options(tiny_corpus, tmp_path, sentences):
    settings = Settings(
        model="tiny", corpus=str(tiny_corpus), sentences=sentences, top_k=4, device="cpu", dtype="float32",
        batch_tokens=128, shard_sentences=8, value_tokens=5, cache_dir=tmp_path / "cache",
    )  # fmt: skip
    return IndexOptions.from_settings(settings, progress=False)


def test_an_analysis_job_waits_for_its_run_and_its_failure_leaves_the_run(db_url, tiny, tmp_path):
    from datetime import timedelta

    from ffmem.engine.errors import FfmemError
    from ffmem.store import jobs
    from ffmem.worker.loop import Worker

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TRAINING_TEXT) + "\n")
    options = _tiny_options(corpus, tmp_path, sentences=None)  # every sentence mined: none held out
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    analysis = AnalysisSpec(examples=5, keys=2, triggers=2, seed=0)
    with sessions() as session:
        index_job, _ = jobs.enqueue(session=session, spec=options.spec)
        waiting, what = jobs.enqueue_analysis(session=session, spec=analysis, after=index_job.id)
        session.commit()
        assert (what, waiting.kind, waiting.run_id, waiting.after_job_id, waiting.options) == (
            "created", "analysis", None, index_job.id, analysis.options(),
        )  # fmt: skip
        # Before its run is built nobody may claim it: the index job goes first, then nothing is left.
        index_id, waiting_id, lease = index_job.id, waiting.id, timedelta(seconds=60)
        assert jobs.claim_job(session=session, worker="a", lease=lease, max_attempts=3).id == index_id
        assert jobs.claim_job(session=session, worker="b", lease=lease, max_attempts=3) is None
        session.rollback()
    worker = Worker(sessions, options, loaded=tiny)
    worker.work(job_id=index_id)
    with pytest.raises(
        FfmemError,
        match="has no sentences beyond the 6 the run read, and it held none out of mining: none is held out",
    ):
        worker.work(job_id=waiting_id)
    with sessions() as session:
        failed, run = session.get(Job, waiting_id), session.scalars(select(Run)).one()
        assert (failed.status, failed.run_id, run.status) == ("failed", run.id, "done")
        assert "none is held out" in failed.error["message"]
        # What was computed before the failure is kept; the run's pages are untouched.
        names = session.scalars(select(Analysis.name).where(Analysis.run_id == run.id)).all()
        assert "agreement" in names and "census" not in names  # those that need no held-out sentences
        # Queued again for the run (as the analysis page does): the failed job is retried.
        again, what = jobs.enqueue_analysis(session=session, spec=analysis, run_id=run.id)
        assert (what, again.id, again.status) == ("resumed", waiting_id, "queued")  # a retry
    engine.dispose()


def test_an_analysis_that_lost_its_job_stops(db_url, tiny, tmp_path):
    from datetime import timedelta

    from sqlalchemy import update

    from ffmem.store import jobs
    from ffmem.worker.leases import LostLease
    from ffmem.worker.loop import Worker

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TRAINING_TEXT + MORE) + "\n")
    options = _tiny_options(corpus, tmp_path, sentences=len(TRAINING_TEXT))
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    summary = build_index(options, sessions, loaded=tiny)
    worker = Worker(sessions, options, loaded=tiny)
    with sessions() as session:
        spec = AnalysisSpec(examples=3, keys=2, triggers=2, seed=0)
        job, _ = jobs.enqueue_analysis(session=session, spec=spec, run_id=summary.run_id)
        claimed = jobs.claim_job(
            session=session, worker=worker.name, lease=timedelta(seconds=60), max_attempts=3
        )
        session.commit()
        assert claimed.id == job.id
    report = worker._reporter(job.id, worker._job_lease(job.id))
    report("census", 1, 4)
    with sessions() as session:
        assert session.get(Job, job.id).progress == {"stage": "census", "done": 1, "total": 4}
        session.execute(update(Job).where(Job.id == job.id).values(worker="someone else"))
        session.commit()
    with pytest.raises(LostLease, match=f"job {job.id} was taken over"):
        report("token_removal", 0, 1)
    engine.dispose()
