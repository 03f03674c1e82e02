"""Index jobs in the browser: start one, its page and JSON twin, progress polling, errors and retry."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, select, update

from ffmem.config import Settings
from ffmem.store import jobs
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import Job, Run, RunStatus, Shard
from ffmem.web.main import create_app

JOB_FIELDS = {
    "id",
    "kind",
    "status",
    "options",
    "after_job_id",
    "progress",
    "attempts",
    "worker",
    "error",
    "created_at",
    "started_at",
    "finished_at",
    "run_id",
}


@pytest.fixture
def app_for(db_url):
    app = create_app(Settings(database_url=db_url))
    yield app
    app.state.engine.dispose()


@pytest.fixture
def client(app_for):
    with TestClient(app_for) as client:
        yield client


def start(client, **form):
    fields = {"model": "smollm2-135m", "corpus": "wiki-vital", "sentences": "40", "top_k": "5"} | form
    return client.post("/jobs", data=fields, follow_redirects=False)


def test_start_a_run_from_the_browser(client, tmp_path):
    response = start(client)
    assert response.status_code == 303 and response.headers["location"] == "/jobs/1"
    body = client.get("/jobs/1.json").json()
    assert body["page"] == "job" and set(body["job"]) == JOB_FIELDS
    assert body["job"]["status"] == "queued" and body["polling"] is True and body["progress"] is None
    assert body["job"]["options"] == {
        "model": "smollm2-135m",
        "corpus": "wiki-vital",
        "sentences": 40,
        "held_out_every": 10,
        "top_k": 5,
        "shaded_triggers": 10,
        "dtype": "auto",
        "max_sentence_tokens": 128,
        "first_position": False,
        "batch_tokens": 4096,
        "shard_sentences": 0,
        "value_tokens": 30,
        "token_memories": 32,
    }
    page = client.get("/jobs/1").text
    assert 'hx-trigger="every 1s"' in page and "waiting for a worker" in page
    assert "<dt>sentences a shard</dt><dd>sized by the model</dd>" in page
    assert start(client).headers["location"] == "/jobs/1"  # the same run is not queued twice
    home = client.get("/.json").json()
    assert [j["id"] for j in home["jobs"]] == [1]
    corpus = tmp_path / "c.txt"
    corpus.write_text("One sentence.\n")
    created = client.post(
        "/jobs.json", data={"model": "m", "corpus": str(corpus), "sentences": "3", "top_k": "2"}
    )
    assert created.status_code == 201 and created.json()["job"]["id"] == 2


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"top_k": "0"}, "top_k: Input should be greater than or equal to 1"),
        (
            {"sentences": "many"},
            "sentences: Input should be a valid integer, unable to parse string as an integer",
        ),
        ({"model": ""}, "model: Field required"),
    ],
)
def test_bad_start_requests_are_400(client, form, message):
    fields = {"model": "smollm2-135m", "corpus": "wiki-vital", "sentences": "40", "top_k": "5"} | form
    response = client.post("/jobs.json", data=fields)
    assert response.status_code == 400 and response.json() == {"ok": False, "error": message, "status": 400}
    assert client.get("/.json").json()["jobs"] == []


def test_the_first_position_option_from_the_form(db_url):
    """Unchecked (the form's hidden "false" alone) or left out by an API client: the setting; checked
    (the checkbox's "true" after the hidden field): on. The form's box starts as the setting says."""
    for setting in (False, True):
        app = create_app(Settings(database_url=db_url, first_position=setting))
        with TestClient(app) as client:
            home = client.get("/").text
            assert ('name="first_position" type="checkbox" value="true" checked' in home) is setting
            cases = [({}, setting), ({"first_position": "false"}, False)]
            cases += [({"first_position": ["false", "true"]}, True)]
            for sentences, (form, wanted) in enumerate(cases, start=1):
                body = start(client, sentences=str(sentences), **form).headers["location"]
                assert client.get(f"{body}.json").json()["job"]["options"]["first_position"] is wanted
            with app.state.sessions() as session:
                session.execute(delete(Job))
                session.commit()
        app.state.engine.dispose()


def test_unknown_job_and_retry_rules(client, app_for):
    assert client.get("/jobs/7.json").json() == {"ok": False, "error": "There is no job 7.", "status": 404}
    start(client)
    conflict = client.post("/jobs/1/retry.json")
    assert conflict.status_code == 409
    assert conflict.json()["error"] == "Job 1 is queued; only a failed job can be retried."
    with app_for.state.sessions() as session:
        try:
            raise RuntimeError("out of memory")
        except RuntimeError as error:
            jobs.fail_job(session=session, job_id=1, error=error)
        session.commit()
    failed = client.get("/jobs/1.json").json()
    assert failed["job"]["error"]["type"] == "RuntimeError" and failed["polling"] is False
    page = client.get("/jobs/1").text
    assert "RuntimeError: out of memory" in page and "Traceback" in page and "hx-trigger" not in page
    retried = client.post("/jobs/1/retry", follow_redirects=False)
    assert retried.status_code == 303 and client.get("/jobs/1.json").json()["job"]["status"] == "queued"


def test_progress_of_a_running_run(db_url, tiny, tiny_model_dir, tmp_path):
    from explorer_index import four_shard_options

    from ffmem.worker.loop import build_index

    sessions = make_sessionmaker(make_engine(db_url))
    build_index(
        four_shard_options(tiny_model_dir, tmp_path),  # 28 sentences, 4 shards of 7
        sessions,
        loaded=tiny,
    )
    with sessions() as session:  # rewind it to: shards 0 and 1 done, shard 2 half-way, shard 3 pending
        session.execute(update(Job).values(status="running"))
        session.execute(update(Run).values(status=RunStatus.running))
        session.execute(update(Shard).where(Shard.index == 2).values(status="running", sentences_done=4))
        session.execute(update(Shard).where(Shard.index == 3).values(status="pending", sentences_done=0))
        session.commit()
        done = sum(s.sentences_done for s in session.scalars(select(Shard)))
    app = create_app(Settings(database_url=db_url))
    with TestClient(app) as client:
        body = client.get("/jobs/1.json").json()
        fragment = client.get("/jobs/1", headers={"HX-Request": "true", "HX-Target": "progress"}).text
        slug = client.get("/.json").json()["models"][0]["model"]["slug"]
        unfinished = client.get(f"/m/{slug}/layers/0.json").json()
    app.state.engine.dispose()
    progress = body["progress"]
    assert done == 7 + 7 + 4
    assert (
        progress["sentences_done"],
        progress["n_sentences"],
        progress["shards"],
        progress["shards_done"],
    ) == (
        18,
        28,
        4,
        2,
    )
    assert progress["fraction"] == pytest.approx(18 / 28) and progress["eta_seconds"] > 0
    assert fragment.lstrip().startswith('<section id="progress" hx-get="/jobs/1"') and "64.3%" in fragment
    assert unfinished == {
        "ok": False,
        "status": 503,
        "error": f"Job 1 is building the first index of '{slug}' (64.3% of the corpus mined; pages show its "
        "results from the first checkpoint). Its progress: /jobs/1",
        "link": "/jobs/1",
    }


def test_an_empty_sentences_field_reads_the_whole_corpus(client):
    """The home page's form leaves `sentences` empty by default: the run reads every sentence."""
    fields = {"model": "smollm2-135m", "corpus": "wiki-vital", "sentences": "", "top_k": "5"}
    response = client.post("/jobs", data=fields, follow_redirects=False)
    assert response.status_code == 303, response.text
    job = client.get(response.headers["location"] + ".json").json()["job"]
    assert job["options"]["sentences"] is None and job["options"]["held_out_every"] == 10
