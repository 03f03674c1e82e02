"""The analysis page on the tiny explorer index: what it says before any analysis, and the form that
queues an analysis job (kept apart from tests that rebuild the database: the index is module-wide)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from ffmem.config import Settings
from ffmem.web.main import create_app


def test_a_run_without_analyses_says_how_to_compute_them(explorer_db, slug):
    """Issue 39: a run without analyses said so in a red notice, offering 4,000 held-out examples to a run
    that holds 1. It says how to compute them — the button and the command — with defaults that fit: the
    tiny index's 16 sentences, every 10th held out (16 // 10 = 1 example), 48 keys a layer, top-T 6."""
    app = create_app(Settings(database_url=explorer_db))
    with TestClient(app) as client:
        body = client.get(f"/m/{slug}/analysis.json").json()
        run = body["run"]["id"]
        assert body["missing"] == ["agreement", "census", "token_removal"] and body["figures"] == []
        assert body["defaults"] == {"examples": 1, "keys": 48, "triggers": 6, "seed": 0}
        command = f"ffmem analyze --run {run} --examples 1 --keys 48 --triggers 6"
        assert body["command"] == command
        page = client.get(f"/m/{slug}/analysis").text
        assert (
            f'<p class="hint" id="analysis-missing">Not computed on run {run} yet: agreement, census, token '
            "removal. To compute them, press <strong>queue</strong> below (a worker computes them as a job) "
            f"or run <code>{command}</code>.</p>"
        ) in page
        assert 'class="notice"' not in page  # not an error
        assert 'name="examples" min="1" max="1000000" value="1"' in page
        assert client.get(f"/m/{slug}/layers/0/keys/0.json").json()["stats"]["shallowness"] is None
    app.state.engine.dispose()
    reader = create_app(Settings(database_url=explorer_db, admin_token="t0ken"))
    with TestClient(reader) as client:  # no token, no button to press: the command alone
        assert f"To compute them, run <code>{command}</code>." in client.get(f"/m/{slug}/analysis").text
    reader.state.engine.dispose()


def test_the_analysis_page_queues_an_analysis_job(explorer_db, slug):
    app = create_app(Settings(database_url=explorer_db))
    with TestClient(app) as client:
        run = client.get(f"/m/{slug}/analysis.json").json()["run"]["id"]
        form = {"run": run, "examples": 7, "keys": 2, "triggers": 3}
        answer = client.post(f"/m/{slug}/analysis.json", data=form)
        assert answer.status_code == 201
        job = answer.json()["job"]
        assert (job["kind"], job["status"], job["run_id"], job["progress"]) == (
            "analysis",
            "queued",
            run,
            None,
        )
        assert job["options"] == {"examples": 7, "keys": 2, "triggers": 3, "seed": 0}  # the run is run_id
        # The same analysis again: the queued job is reused; the HTML form redirects to its page.
        redirect = client.post(f"/m/{slug}/analysis", data=form, follow_redirects=False)
        assert (redirect.status_code, redirect.headers["location"]) == (303, f"/jobs/{job['id']}")
        listed = client.get(f"/m/{slug}/analysis.json").json()["jobs"]
        assert [(j["id"], j["kind"]) for j in listed] == [(job["id"], "analysis")]
        assert "Analysis job" in client.get(f"/jobs/{job['id']}").text
        assert f'href="/jobs/{job["id"]}"' in client.get(f"/m/{slug}/analysis").text
        bad = client.post(f"/m/{slug}/analysis.json", data=form | {"triggers": 0})
        assert bad.status_code == 400 and bad.json()["ok"] is False
        unknown = client.post(f"/m/{slug}/analysis.json", data=form | {"run": 999})
        assert unknown.status_code == 404 and "has no run 999" in unknown.json()["error"]
    app.state.engine.dispose()


def test_the_form_offers_the_settings_sizes(explorer_db, slug):
    """Each field of the form holds its setting (not `ctx.defaults.keys`, the dict's method), no more than
    the run holds: 321 examples → its 1 held-out sentence; 17 of its 48 keys; 5 of its top-6 triggers."""
    settings = Settings(
        database_url=explorer_db,
        admin_token="t0ken",
        analysis_examples=321,
        analysis_keys=17,
        analysis_triggers=5,
    )
    app = create_app(settings)
    with TestClient(app, headers={"Authorization": "Bearer t0ken"}) as client:
        page = client.get(f"/m/{slug}/analysis")
    app.state.engine.dispose()
    assert page.status_code == 200 and 'id="start-analysis"' in page.text
    assert 'name="examples" min="1" max="1000000" value="1"' in page.text
    assert 'name="keys" min="1" max="1000000" value="17"' in page.text
    assert 'name="triggers" min="1" max="1000" value="5"' in page.text
    assert "built-in method" not in page.text
