"""While a run mines, the model, layer and key pages show what is known so far, marked provisional;
the numbers are exactly those of the shards mined so far; once stored, the pages show the final run."""

from __future__ import annotations

import pytest
from explorer_index import four_shard_options
from fastapi.testclient import TestClient
from sqlalchemy import select

from ffmem.config import Settings
from ffmem.engine.mining.batches import mine_batches, shard_batches
from ffmem.engine.mining.corpus import mined_from
from ffmem.engine.mining.state import MiningState
from ffmem.engine.model.model_names import slugify
from ffmem.store import jobs
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.key_examples import samples_of
from ffmem.store.models import LanguageModel
from ffmem.web.main import create_app
from ffmem.worker.loop import Worker


def test_pages_fill_in_while_the_run_mines(db_url, tiny, tiny_model_dir, tmp_path):
    options = four_shard_options(tiny_model_dir, tmp_path)  # 28 sentences: 4 shards of 7
    sessions = make_sessionmaker(make_engine(db_url))
    with sessions() as session:
        job, _ = jobs.enqueue(session=session, spec=options.spec)
        session.commit()
    worker = Worker(sessions, options, loaded=tiny)
    app = create_app(Settings(database_url=db_url))
    slug = slugify(str(tiny_model_dir))
    with TestClient(app) as client:  # queued: no model stored yet, but its job says what it is doing
        for path in (f"/m/{slug}", f"/m/{slug}/layers/1/keys/5"):
            page = client.get(path)
            assert (page.status_code, page.headers["retry-after"]) == (503, "10")
            assert f'<a id="next" href="/jobs/{job.id}">See job {job.id}</a>' in page.text
        assert client.get(f"/m/{slug}.json").json() == {
            "ok": False,
            "error": f"Job {job.id} is preparing the index of {slug!r} (queued, waiting for a worker). "
            f"Its progress: /jobs/{job.id}",
            "status": 503,
            "link": f"/jobs/{job.id}",
        }
        assert client.get("/m/no-such-model.json").status_code == 404
        assert worker.step()  # prepare: corpus, run, shards, values
        building = client.get(f"/m/{slug}/layers/1.json")  # the model is stored, nothing mined yet
        assert building.status_code == 503 and building.json()["error"] == (
            f"Job {job.id} is building the first index of {slug!r} (0.0% of the corpus mined; "
            f"pages show its results from the first checkpoint). Its progress: /jobs/{job.id}"
        )
    assert worker.step()  # mine shard 0 (every 4th sentence from 0: 7 of 28) and merge it
    with sessions() as session:
        slug = session.scalars(select(LanguageModel.slug)).one()
        token_ids, first_positions, _ = worker.index.corpus(1)
        ids = [list(map(int, sentence)) for sentence in token_ids]
    # What shard 0 alone mines, computed directly, from the positions the run mines (not position 0).
    first = mined_from(first_positions, first_position=False)
    assert set(first) == {1}
    alone = MiningState(3, 48, 4, gated=True)
    mine_batches(
        tiny, shard_batches(ids, first, shard=0, shard_sentences=8, batch_tokens=64, pad_id=0), alone
    )

    with TestClient(app) as client:
        key = client.get(f"/m/{slug}/layers/1/keys/5.json").json()
        assert key["provisional"] == pytest.approx(0.25) and key["run"]["status"] == "running"
        assert key["run"]["job"] == job.id and key["run"]["mined"] == pytest.approx(0.25)
        coefficients, sentences, positions = alone.triggers(1, 1)
        assert [t["sentence_index"] for t in key["triggers"]] == sentences[5].tolist()
        assert [t["position"] for t in key["triggers"]] == positions[5].tolist()
        assert [t["coefficient"] for t in key["triggers"]] == pytest.approx(coefficients[5].tolist())
        assert key["stats"]["positive_share"] == pytest.approx(float(alone.positive_share(1)[5]))
        assert key["stats"]["density"] == pytest.approx(float(alone.density(1)[5]))
        assert key["histogram"]["counts"] == alone.histogram[1, 5].tolist()
        mined_layer = alone.layer(1)
        shares = [q["share"] for q in key["quadrants"]["quadrants"]]
        assert shares == pytest.approx(mined_layer.quadrant_shares()[5].tolist())
        nn = client.get(f"/m/{slug}/layers/1/keys/5/quadrants/nn.json").json()
        assert nn["provisional"] == pytest.approx(0.25)
        kept = mined_layer.quadrant_sentence[5, 3]
        assert [e["sentence_index"] for e in nn["examples"]] == kept[kept >= 0].tolist()
        assert key["value"]["raw"]["top"], "values are projected before mining starts"
        banner = client.get(f"/m/{slug}/layers/1/keys/5").text
        assert "provisional — 25.0% of the corpus</strong> in these results" in banner
        assert f'<a href="/jobs/{job.id}">job {job.id}</a> has mined 25.0% so far' in banner
        # Its examples across the range: those shard 0 sampled, unshaded until the run is stored.
        examples = client.get(f"/m/{slug}/layers/1/keys/5/samples.json").json()
        expected = samples_of(alone.layer(1), 5)
        assert examples["provisional"] == pytest.approx(0.25) and len(examples["samples"]) == len(expected)
        assert sorted((s["bin"], s["sentence_index"], s["position"]) for s in examples["samples"]) == sorted(
            (s.bin, s.sentence_index, s.position) for s in expected
        )
        assert all(s["shading"] is None for s in examples["samples"])
        assert "provisional — 25.0%" in client.get(f"/m/{slug}/layers/1/keys/5/samples").text

        layer = client.get(f"/m/{slug}/layers/1.json?sort=max_coefficient&order=desc&per_page=5").json()
        best = alone.triggers(1, 1)[0][:, 0]  # [keys]
        assert [k["key"] for k in layer["keys"]] == best.argsort(descending=True)[:5].tolist()
        assert layer["provisional"] == pytest.approx(0.25) and layer["total"] == 48
        assert layer["keys"][0]["max_coefficient"] == pytest.approx(float(best.max()))
        model = client.get(f"/m/{slug}.json").json()
        assert model["provisional"] == pytest.approx(0.25) and len(model["layers"]) == 3
        assert model["layers"][1]["density"] == pytest.approx(float(alone.density(1).mean()))
        assert "provisional — 25.0%" in client.get(f"/m/{slug}").text

        worker.work(job_id=job.id)  # the rest of the run, stored
        final = client.get(f"/m/{slug}/layers/1/keys/5.json").json()
        assert final["provisional"] is None and final["run"]["status"] == "done"
        assert (final["run"]["job"], final["run"]["mined"]) == (None, None)
        assert max(t["sentence_index"] for t in final["triggers"]) >= 0
        assert "provisional" not in client.get(f"/m/{slug}/layers/1/keys/5").text.split("<main>")[1]
        examples = client.get(f"/m/{slug}/layers/1/keys/5/samples.json").json()
        assert examples["provisional"] is None and all(s["shading"] for s in examples["samples"])
    app.state.engine.dispose()
