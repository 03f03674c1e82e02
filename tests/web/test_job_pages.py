"""Index jobs in the browser: start one, its page and JSON twin, progress polling, errors and retry."""

from __future__ import annotations

import html
import re
from datetime import datetime, timedelta, timezone

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
    "attempt",
    "past_attempts",
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
        "explain_sentences": 1000,
        "explain_top_records": 20,
        "explain_random_records": 20,
        "explain_quadrants": False,
        "explainer_model": "",
        "token_change_memories": 2000,
        "token_change_contexts": 8,
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
    # Issue 39: the pages say "all", not "None" (the home page's jobs table) nor "—" (the job, the jobs list).
    home = client.get("/").text.split('<table class="runs">')[-1]
    assert '<td>wiki-vital</td><td class="num">all</td><td class="num">5</td>' in home and "None" not in home
    assert "<dt>sentences</dt><dd>all</dd>" in client.get(response.headers["location"]).text
    assert "smollm2-135m over wiki-vital, all sentences, top-T 5" in client.get("/jobs").text


def _fail(sessions, job_id: int, started: datetime, seconds: int, message: str) -> None:
    """The job's current attempt, taken up by a worker at `started`, failed `seconds` later."""
    with sessions() as session:
        if session.get(Job, job_id).status == "queued":
            jobs.claim_job(
                session=session, worker="w", lease=timedelta(minutes=2), max_attempts=3, job_id=job_id
            )
        jobs.fail_job(session=session, job_id=job_id, error=RuntimeError(message))
        ended = started + timedelta(seconds=seconds)
        session.execute(update(Job).where(Job.id == job_id).values(started_at=started, finished_at=ended))
        session.commit()


def test_a_job_queued_again_shows_each_attempt_with_its_own_times(client, app_for):
    """Issue 39 (3): a failed job queued again (the retry button, or the home page's form posted again) is
    its next attempt: its page and JSON show the current attempt's own start and end (not the first's) and
    every failed attempt before it (start, end, duration, error); `attempt` counts them."""
    start(client)
    first = datetime(2026, 11, 29, 10, 0, 0, tzinfo=timezone.utc)
    _fail(app_for.state.sessions, 1, first, 72, "out of memory")
    assert client.post("/jobs/1/retry", follow_redirects=False).headers["location"] == "/jobs/1"
    job = client.get("/jobs/1.json").json()["job"]
    assert (job["status"], job["attempt"], job["attempts"], job["started_at"], job["finished_at"]) == (
        "queued", 2, 0, None, None,
    )  # fmt: skip
    (past,) = job["past_attempts"]
    assert (past["started_at"], past["finished_at"], past["seconds"]) == (
        "2026-11-29T10:00:00Z", "2026-11-29T10:01:12Z", 72.0,
    )  # fmt: skip
    assert (past["error"]["type"], past["error"]["message"]) == ("RuntimeError", "out of memory")
    second = first + timedelta(hours=1)
    _fail(app_for.state.sessions, 1, second, 5, "disk full")
    assert start(client).headers["location"] == "/jobs/1"  # the form posted again: the third attempt
    _fail(
        app_for.state.sessions, 1, second + timedelta(hours=1), 3 * 60 + 1, "https://example.org/" + "x" * 50
    )
    body = client.get("/jobs/1.json").json()["job"]
    assert (body["attempt"], body["attempts"], body["status"]) == (3, 1, "failed")
    assert [(a["seconds"], a["error"]["message"]) for a in body["past_attempts"]] == [
        (72.0, "out of memory"), (5.0, "disk full"),
    ]  # fmt: skip
    page = client.get("/jobs/1").text
    assert (
        'failed <time datetime="2026-11-29T12:03:01+00:00">2026-11-29 12:03:01 UTC</time> (took 3 min 1 s)'
        in page
    )
    rows = page.split('id="past-attempts"')[1].split("</table>")[0]
    assert "Attempt 3: the job failed 2 times before and was queued again" in rows
    assert rows.count("<tr>") == 3 and "1 min 12 s" in rows and "5 s" in rows
    assert "RuntimeError: out of memory" in rows and "RuntimeError: disk full" in rows
    assert "· attempt 3</p>" in page


def test_a_job_never_failed_is_its_first_attempt(client):
    start(client)
    job = client.get("/jobs/1.json").json()["job"]
    assert (job["attempt"], job["past_attempts"]) == (1, [])
    assert 'id="past-attempts"' not in client.get("/jobs/1").text


@pytest.mark.parametrize("local", [True, False])
def test_a_queued_job_says_whether_the_servers_own_worker_takes_it(tmp_path, monkeypatch, local):
    """Issue 39 (3): `ffmem serve` without --worker-url starts its own worker: a queued job's page says
    that worker takes it (JSON `local_worker`); with --worker-url it names `ffmem worker`."""
    import uvicorn
    from typer.testing import CliRunner

    from ffmem.cli import cli
    from ffmem.config import get_settings

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: served.update(app=app))
    monkeypatch.setattr("ffmem.cli.serve.signal.signal", lambda *args: None)
    monkeypatch.setattr("ffmem.cli.serve._LocalWorker", lambda command: served.update(worker=command))
    get_settings.cache_clear()
    url = f"sqlite:///{tmp_path / 'serve.db'}"
    option = [] if local else ["--worker-url", "http://127.0.0.1:9"]
    result = CliRunner().invoke(cli, ["serve", "--db", url, *option])
    get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    assert ("worker" in served) is local
    with TestClient(served["app"]) as client:
        start(client)
        body = client.get("/jobs/1.json").json()
        page = client.get("/jobs/1").text
    served["app"].state.engine.dispose()
    assert body["local_worker"] is local
    own = "waiting for this server's own worker (started by <code>ffmem serve</code>)"
    assert (own in page) is local
    assert ("waiting for a worker (<code>ffmem worker</code>)" in page) is not local


@pytest.mark.parametrize("refused", ["blank model", "folder", "binary file"])
def test_a_refused_model_or_corpus_is_shown_next_to_its_field_with_the_typed_values_kept(
    client, tmp_path, refused
):
    """Issue 39: the home page again (400), the message next to the field (the JSON twin's error), the
    values typed kept in the form; nothing queued."""
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    field, form = {
        "blank model": ("model", {"model": "   "}),
        "folder": ("corpus", {"corpus": str(tmp_path)}),
        "binary file": ("corpus", {"corpus": str(binary)}),
    }[refused]
    fields = {
        "model": "org/model",
        "corpus": "wiki-vital",
        "sentences": "40",
        "top_k": "7",
        "analyze": "true",
    }
    fields |= form
    message = client.post("/jobs.json", data=fields).json()["error"]
    response = client.post("/jobs", data=fields, follow_redirects=False)
    assert response.status_code == 400 and '<form class="start" id="start"' in response.text
    errors = dict(
        re.findall(r'<span class="field-error" id="(\w+)-error" role="alert">(.*?)</span>', response.text)
    )
    assert errors == {"model": "", "corpus": "", field: html.escape(message)}
    kept = {"model": fields["model"].strip(), "corpus": fields["corpus"]}
    for name, value in kept.items():
        assert f'<input name="{name}" value="{html.escape(value)}"' in response.text
    assert 'placeholder="all" value="40"' in response.text and 'max="1000" value="7"' in response.text
    assert 'name="analyze" type="checkbox" value="true" checked' in response.text
    assert client.get("/.json").json()["jobs"] == []
