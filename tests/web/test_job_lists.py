"""Every kind of job in the lists of jobs (the home page's and /jobs): a comparison or composition job
listed beside index and analysis jobs, each said in its own words (a comparison's runs, a composition's
held-out sentences), where both pages answered 500 once one was queued."""

from __future__ import annotations

import re
from html import unescape

from ffmem.store import analyses, jobs
from ffmem.store.specs import AnalysisSpec, ComparisonSpec, CompositionSpec


def test_every_kind_of_job_is_listed_in_its_words(client, db, run):
    spec = dict(explain_sentences=40, explainer_model="none", batch_tokens=512)
    composed, _ = jobs.enqueue(session=db, spec=CompositionSpec(**spec), run_id=run.id)
    compared, _ = jobs.enqueue(session=db, spec=ComparisonSpec(runs=[run.id, run.id + 1]))
    analysis = AnalysisSpec(examples=1200, keys=4, triggers=3, seed=0)
    analyzed, _ = jobs.enqueue(session=db, spec=analysis, run_id=run.id)
    db.commit()
    words = {
        composed.id: "weight graph and explanations, 40 held-out sentences",
        compared.id: f"runs {run.id} and {run.id + 1} side by side",
        analyzed.id: "1,200 examples, 4 keys × 3 triggers a layer",
    }
    for path, prefix in [("/", ""), ("/jobs", "analyses: ")]:
        page = client.get(path)
        assert page.status_code == 200, page.text[-2000:]
        rows = {
            int(job): unescape(re.sub(r"<[^>]+>", "", row))
            for job, row in re.findall(r'<a href="/jobs/(\d+)">\d+</a></td>(.*?)</tr>', page.text, re.S)
        }
        for job, said in words.items():
            assert (prefix if job == analyzed.id else "") + said in rows[job], (path, rows[job])
    titles = {composed.id: "Composition job", compared.id: "Comparison job", analyzed.id: "Analysis job"}
    for job, title in titles.items():
        assert f"<h1>{title} {job}</h1>" in client.get(f"/jobs/{job}").text


def test_the_job_page_says_where_the_explainer_failed(client, db, run):
    """A run explained with a local explainer that failed on some sides: its composition job's page says how
    many kept their token-table descriptions and that it stopped asking."""
    spec = CompositionSpec(explain_sentences=40, explainer_model="local", batch_tokens=512)
    job, _ = jobs.enqueue(session=db, spec=spec, run_id=run.id)
    stored = analyses.stored_analyses(session=db, run_id=run.id)["explanations"]
    before = (dict(stored.options), dict(stored.data), stored.seconds)
    failed = {
        "explainer_sides": 96,
        "explainer_failures": 40,
        "explainer_gave_up": True,
        "simulated_sides": 3,
    }
    analyses.store_analysis(
        session=db,
        run_id=run.id,
        name="explanations",
        options=before[0],
        data=before[1] | failed,
        seconds=1.0,
    )
    db.commit()
    try:
        body = client.get(f"/jobs/{job.id}.json").json()
        assert body["explainer"] == {
            "sides": 96,
            "failures": 40,
            "gave_up": True,
            "simulated": 3,
            "simulation_failures": 0,
        }
        page = unescape(re.sub(r"<[^>]+>", "", client.get(f"/jobs/{job.id}").text))
        assert "failed or was too slow on 40 of 96 sides of memories" in page
        assert "it stopped asking" in page and "keep their token-table descriptions" in page
    finally:
        analyses.store_analysis(
            session=db,
            run_id=run.id,
            name="explanations",
            options=before[0],
            data=before[1],
            seconds=before[2],
        )
        db.commit()
    assert client.get(f"/jobs/{job.id}.json").json()["explainer"] is None  # asked no explainer
