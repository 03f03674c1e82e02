"""What a first hour needs, as HTML and JSON on the tiny index (SQLite and Postgres): the home page's next
steps, /jobs as a list, a job's times and attempts, a label deleted (a write), corpora uploaded (a write:
the CLI reader's checks, a size limit, exact error shapes), errors that name their field, the favicon,
the heatmap mode, and the charts' axes."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from ffmem.config import Settings
from ffmem.store.models import Job, Label
from ffmem.web.display import signed, tail_words
from ffmem.web.main import create_app
from ffmem.web.pages.analysis import AnalysisFigure, analysis_chart
from ffmem.web.pages.model import LayerSummary, layer_lines

TOKEN = "s3cret-token"
HTMX = {"HX-Request": "true"}


@pytest.fixture
def serve(explorer_db, db, tmp_path):
    """serve(**settings) → a TestClient on the tiny index, uploads under tmp_path; labels cleared first."""
    db.execute(Label.__table__.delete())
    db.commit()
    apps = []

    def start(**settings) -> TestClient:
        settings = {"upload_dir": tmp_path / "uploads", "worker_url": "http://127.0.0.1:9"} | settings
        app = create_app(Settings(database_url=explorer_db, **settings))
        apps.append(app)
        return TestClient(app)

    yield start
    for app in apps:
        app.state.engine.dispose()


def labels(db) -> list[tuple[int, str]]:
    db.expire_all()
    return [(label.id, label.pattern) for label in db.scalars(select(Label).order_by(Label.id))]


# ---- home, jobs, favicon ---------------------------------------------------------------------------


def test_home_page_gives_the_next_steps(serve, slug):
    client = serve()
    start = client.get("/.json").json()["start"]
    assert start == {
        "model": slug,
        "prompt": "The capital of France is",
        "live_view": f"/m/{slug}/trace?text=The+capital+of+France+is",
        "search": f"/m/{slug}/search",
        "analysis": f"/m/{slug}/analysis",
        "layers": f"/m/{slug}",
        "top_layer": f"/m/{slug}/layers/2?sort=agreement&order=desc",
    }
    page = client.get("/").text
    for link in ("start-live", "start-search", "start-analysis", "start-layers"):
        assert f'id="{link}"' in page
    assert re.search(rf'<form class="searchbox" action="/m/{slug}/search"', page)  # the header's box
    assert 'list="corpus-choices"' in page and '<option value="wiki-vital">' in page


def test_no_model_yet_says_how_to_build_one(tmp_path):
    from ffmem.store.db import upgrade

    url = f"sqlite:///{tmp_path / 'empty.db'}"
    upgrade(url)
    app = create_app(Settings(database_url=url, upload_dir=tmp_path / "uploads"))
    with TestClient(app) as client:
        assert client.get("/.json").json()["start"] is None
        page = client.get("/").text
        assert "No model is indexed yet" in page and 'class="searchbox"' not in page
    app.state.engine.dispose()


def test_jobs_is_a_list_of_jobs(serve, db):
    client = serve()
    ids = [job.id for job in db.scalars(select(Job).order_by(Job.id.desc()))]
    assert ids, "the index was built by a job"
    body = client.get("/jobs.json").json()
    assert body["page"] == "jobs" and body["limit"] == 100
    assert [job["id"] for job in body["jobs"]] == ids  # the newest first
    assert {"kind", "status", "options", "attempts", "created_at", "started_at", "finished_at"} <= set(
        body["jobs"][0]
    )
    page = client.get("/jobs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert f'<a href="/jobs/{ids[0]}">{ids[0]}</a>' in page.text
    assert client.get("/jobs.json", params={"limit": 1}).json()["jobs"][0]["id"] == ids[0]
    bad = client.get("/jobs.json", params={"limit": 0})
    assert bad.status_code == 400 and bad.json()["ok"] is False


def test_a_job_page_gives_its_times(serve, db):
    client = serve()
    job = db.scalars(select(Job).order_by(Job.id)).first()
    page = client.get(f"/jobs/{job.id}").text
    times = re.search(r'<p class="meta" id="job-times">(.*?)</p>', page, re.S).group(1)
    assert "queued" in times and "started" in times and "ended" in times and "took" in times
    assert f'<time datetime="{job.created_at.isoformat()[:19]}' in times
    assert "top-T" in page and "top k" not in page  # one name for it
    first = job.options["first_position"]
    said = "mined" if first else "left out: mining starts at each sentence&#39;s second token"
    assert f"<dt>each sentence&#39;s first token</dt><dd>{said}</dd>" in page
    assert "False" not in page and "True" not in page


def test_head_is_answered_as_get_without_a_body(serve, db):
    client = serve()
    job = db.scalars(select(Job).order_by(Job.id)).first()
    for path in ("/", f"/jobs/{job.id}", "/.json"):
        head, get = client.head(path), client.get(path)
        assert (head.status_code, head.content) == (200, b"")
        assert head.headers["content-type"] == get.headers["content-type"]
    assert client.head("/no/such/page").status_code == 404


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (0.0, "0"),
        (-0.0, "0"),
        (0.01234, "+0.0123"),
        (-0.5, "-0.5000"),
        (-3.2e-6, "-3.2e-06"),
        (4e-5, "+4.0e-05"),
    ],
)
def test_a_change_too_small_for_its_decimals_keeps_its_digits(value, shown):
    assert signed(value) == shown


def test_a_job_page_explains_a_second_attempt(serve, db):
    client = serve()
    job = db.scalars(select(Job).order_by(Job.id)).first()
    before = job.attempts
    assert 'id="job-attempts"' not in client.get(f"/jobs/{job.id}").text  # a first attempt needs no word
    job.attempts = 2
    db.commit()
    try:
        page = client.get(f"/jobs/{job.id}").text
        attempts = re.search(r'<p class="meta" id="job-attempts">(.*?)</p>', page, re.S).group(1)
        assert attempts.startswith("Take-up 2 of this step, of at most 3: a worker took this step up again")
        assert "stopped answering" in attempts and "Past 3 take-ups the job fails" in attempts
        capped = serve(max_attempts=5).get(f"/jobs/{job.id}").text
        assert "Take-up 2 of this step, of at most 5" in capped
    finally:
        job.attempts = before
        db.commit()


def test_the_favicon_is_served(serve):
    client = serve()
    icon = client.get("/favicon.ico")
    assert icon.status_code == 200 and icon.content[:4] == b"\x00\x00\x01\x00"  # an ICO
    assert client.get("/static/favicon.svg").status_code == 200
    assert '<link rel="icon" href="/static/favicon.svg"' in client.get("/").text


# ---- labels: the author kept, a label deleted -----------------------------------------------------


def test_the_author_is_kept_after_saving_a_label(serve, slug):
    client = serve()
    url = f"/m/{slug}/layers/1/keys/4"
    client.post(f"{url}/labels", data={"pattern": "a city", "author": "ada"})  # follows the redirect
    page = client.get(f"{url.replace('keys/4', 'keys/5')}").text  # another key: the same name offered
    assert 'aria-label="author" value="ada"' in page
    as_htmx = HTMX | {"HX-Target": "label"}  # as the key page's label form sends it
    fragment = client.post(f"{url}/labels", data={"pattern": "a capital", "author": "bob"}, headers=as_htmx)
    assert fragment.status_code == 200
    assert fragment.text.lstrip().startswith('<section class="label" id="label">')
    assert 'aria-label="author" value="bob"' in fragment.text and "a capital" in fragment.text


def test_delete_a_label_brings_back_the_one_before(serve, db, slug):
    client = serve()
    url = f"/m/{slug}/layers/1/keys/4/labels"
    first = client.post(f"{url}.json", data={"pattern": "ends with a city"}).json()["label"]
    second = client.post(f"{url}.json", data={"pattern": "ends with a capital"}).json()["label"]
    answer = client.post(f"{url}/{second['id']}/delete.json")
    assert answer.status_code == 200
    body = answer.json()
    assert body["deleted"]["id"] == second["id"] and body["deleted"]["pattern"] == "ends with a capital"
    assert body["label"]["id"] == first["id"] and body["history"] == 0
    assert client.get(f"/m/{slug}/layers/1/keys/4.json").json()["label"]["pattern"] == "ends with a city"
    redirect = client.post(f"{url}/{first['id']}/delete", follow_redirects=False)
    assert (redirect.status_code, redirect.headers["location"]) == (303, f"/m/{slug}/layers/1/keys/4")
    assert labels(db) == []
    assert client.get(f"/m/{slug}/layers/1/keys/4.json").json()["label"] is None


def test_deleting_an_unknown_or_another_keys_label_is_a_404(serve, db, slug):
    client = serve()
    other = client.post(f"/m/{slug}/layers/1/keys/5/labels.json", data={"pattern": "x"}).json()["label"]
    for path in (f"layers/1/keys/4/labels/{other['id']}", f"layers/1/keys/4/labels/{other['id'] + 99}"):
        answer = client.post(f"/m/{slug}/{path}/delete.json")
        assert answer.status_code == 404
        assert answer.json() == {
            "ok": False,
            "error": f"Layer 1, key 4 has no label {path.rsplit('/', 1)[1]}.",
            "status": 404,
        }
    assert labels(db) == [(other["id"], "x")]


@pytest.mark.parametrize(
    ("settings", "headers", "status"),
    [
        ({"admin_token": TOKEN}, {}, 401),
        ({"admin_token": TOKEN}, {"Authorization": "Bearer wrong"}, 403),
        ({"read_only": True}, {}, 403),
        ({"host": "0.0.0.0"}, {}, 403),
    ],
)
def test_only_a_writer_deletes_a_label(serve, db, slug, settings, headers, status):
    writer = serve()
    made = writer.post(f"/m/{slug}/layers/1/keys/4/labels.json", data={"pattern": "kept"}).json()["label"]
    answer = serve(**settings).post(
        f"/m/{slug}/layers/1/keys/4/labels/{made['id']}/delete.json", headers=headers
    )
    assert answer.status_code == status and answer.json()["ok"] is False
    assert labels(db) == [(made["id"], "kept")]


def test_an_empty_label_to_htmx_names_its_field(serve, slug):
    answer = serve().post(f"/m/{slug}/layers/1/keys/4/labels", data={"pattern": " "}, headers=HTMX)
    assert answer.status_code == 400
    assert answer.headers["X-Error-Field"] == "pattern" and answer.headers["HX-Push-Url"] == "false"
    assert "Give a pattern description" in answer.text and "<html" not in answer.text


# ---- corpora: upload and list -------------------------------------------------------------------------


def upload(client, name: str, content: bytes, **kwargs):
    return client.post("/corpora.json", files={"file": (name, content, "application/octet-stream")}, **kwargs)


def test_upload_a_text_corpus_counts_its_lines_as_the_cli_does(serve, tmp_path):
    client = serve()
    text = "One sentence. Another one.\n\n   \n" + "y" * 10_001 + "\nA last line\n"
    answer = upload(client, "../../etc/My Notes.TXT", text.encode())
    assert answer.status_code == 201
    body = answer.json()
    stored = body["corpus"]
    assert body["already"] is False
    assert (stored["name"], stored["lines"], stored["skipped"]) == (
        "../../etc/My Notes.TXT",
        2,
        {"empty": 2, "too_long": 1},
    )
    path = (tmp_path / "uploads").resolve()
    assert stored["corpus"] == str(path / f"{stored['sha256'][:12]}-My_Notes.txt")  # no folder escapes
    assert open(stored["corpus"], "rb").read() == text.encode()
    renamed = upload(client, "other name.txt", text.encode())  # the same text under another name: its own
    assert renamed.status_code == 201 and renamed.json()["corpus"]["corpus"].endswith("-other_name.txt")
    same = upload(client, "../../etc/My Notes.TXT", text.encode())
    assert same.status_code == 200 and same.json()["already"] is True
    listed = client.get("/corpora.json").json()
    assert listed["bundled"] == "wiki-vital" and listed["max_upload_bytes"] == 20_000_000
    assert stored["corpus"] in [f["corpus"] for f in listed["files"]]
    assert listed["indexed"] and listed["indexed"][0]["n_sentences"] > 0  # the index run's corpus
    page = client.get("/corpora", params={"uploaded": stored["corpus"]}).text
    assert 'id="upload-result"' in page and "2 usable lines" in page and "2 blank, 1 longer than" in page


def test_upload_a_jsonl_corpus_skips_bad_records_by_reason(serve):
    lines = [
        json.dumps({"text": "A good record."}),
        "not json at all",
        json.dumps(["a", "list"]),
        json.dumps({"title": "no text"}),
        json.dumps({"text": "Another good one."}),
    ]
    answer = upload(serve(), "records.jsonl", "\n".join(lines).encode())
    assert answer.status_code == 201
    stored = answer.json()["corpus"]
    assert stored["lines"] == 2
    assert stored["skipped"] == {"invalid_json": 1, "not_object": 1, "no_text": 1}


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "picture.txt",
            bytes(range(256)) * 40,
            "The corpus picture.txt is not UTF-8 text: 61% of its first 8,192 bytes are control characters "
            "or not UTF-8 (a binary file?); pass wiki-vital, a UTF-8 .txt file or a .jsonl file.",
        ),
        (
            "empty.txt",
            b"",
            "The corpus empty.txt is empty; pass wiki-vital, a UTF-8 .txt file or a .jsonl file.",
        ),
        (
            "blank.txt",
            b"\n \n\t\n",
            "blank.txt has no usable line (skipped: 3 blank); save it as UTF-8 text.",
        ),
        (
            "picture.png",
            b"\x89PNG\r\n",
            "picture.png is not a .txt or .jsonl file: upload UTF-8 text (one or more sentences a line) or "
            'JSON lines with a "text" field.',
        ),
    ],
)
def test_an_unusable_upload_is_a_400_that_says_why(serve, tmp_path, name, content, message):
    client = serve()
    answer = upload(client, name, content)
    assert answer.status_code == 400
    assert answer.json() == {"ok": False, "error": message, "status": 400}
    assert client.get("/corpora.json").json()["files"] == []
    assert [p.name for p in (tmp_path / "uploads").glob("*")] == []  # nothing left behind
    fragment = client.post("/corpora", files={"file": (name, content)}, headers=HTMX)
    assert fragment.status_code == 400 and fragment.headers["X-Error-Field"] == "file"


def test_an_upload_over_the_limit_is_a_413(serve):
    client = serve(max_upload_bytes=1000)
    answer = upload(client, "big.txt", b"A sentence.\n" * 200)
    assert answer.status_code == 413
    assert answer.json() == {
        "ok": False,
        "error": "The file is larger than 1,000 bytes, the most this server accepts for a corpus upload "
        "(FFMEM_MAX_UPLOAD_BYTES); put a larger one where the workers read it and pass its path.",
        "status": 413,
    }
    assert upload(client, "small.txt", b"A sentence.\n" * 20).status_code == 201  # under it: fine
    assert client.post("/jobs.json", content=b"x" * 70_000).status_code == 413  # other bodies: 64 KiB


@pytest.mark.parametrize(
    ("settings", "headers", "status"),
    [
        ({"admin_token": TOKEN}, {}, 401),
        ({"admin_token": TOKEN}, {"X-Admin-Token": "wrong"}, 403),
        ({"read_only": True}, {}, 403),
        ({"host": "0.0.0.0"}, {}, 403),
        ({"admin_token": TOKEN}, {"Authorization": f"Bearer {TOKEN}"}, 201),
    ],
)
def test_only_a_writer_uploads(serve, settings, headers, status):
    client = serve(**settings)
    answer = upload(client, "notes.txt", b"One line.\n", headers=headers)
    assert answer.status_code == status
    assert len(client.get("/corpora.json").json()["files"]) == (1 if status == 201 else 0)
    if status != 201:
        assert answer.json()["ok"] is False
        assert 'id="upload"' not in client.get("/corpora").text  # no form for a client that may not write


def test_an_html_upload_goes_to_the_corpora_page(serve):
    client = serve()
    answer = client.post("/corpora", files={"file": ("a.txt", b"Hello there.\n")}, follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"].startswith("/corpora?uploaded=")
    page = client.get(answer.headers["location"]).text
    assert "<strong>a.txt</strong> is uploaded: 1 usable line;" in page


# ---- the live view: errors by field, the heatmap mode ------------------------------------------------


def test_a_bad_edit_names_its_field(serve, slug):
    client = serve()
    page = client.get(f"/m/{slug}/trace", params={"text": "Paris", "intervene": "L99K1"})
    assert page.status_code == 400
    slot = re.search(r'<span class="field-error" id="intervene-error" role="alert">(.*?)</span>', page.text)
    assert slot and "layer 99" in slot.group(1).lower()
    assert 'id="worker-notice"' not in page.text
    bad_edit = {"text": "Paris", "intervene": "garbage"}
    fragment = client.get(f"/m/{slug}/trace", params=bad_edit, headers=HTMX | {"HX-Target": "trace"})
    assert fragment.status_code == 400 and fragment.headers["X-Error-Field"] == "intervene"
    assert "Bad intervention" in fragment.text and "<form" not in fragment.text


def test_the_heatmap_mode_is_a_parameter(serve, slug):
    client = serve()
    assert client.get(f"/m/{slug}/trace.json").json()["heatmap_mode"] == "ff_logit"
    active = client.get(f"/m/{slug}/trace.json", params={"heatmap": "active"}).json()
    assert active["heatmap_mode"] == "active"
    bad = client.get(f"/m/{slug}/trace.json", params={"heatmap": "pie"})
    assert bad.status_code == 400 and bad.json()["error"].startswith("heatmap: Input should be")


def test_an_over_long_search_names_its_field(serve, slug):
    client = serve()
    answer = client.get(f"/m/{slug}/search", params={"q": "x" * 201}, headers=HTMX)
    assert answer.status_code == 400 and answer.headers["X-Error-Field"] == "q"
    assert "at most 200 characters" in answer.text
    assert 'maxlength="200"' in client.get(f"/m/{slug}/search").text
    page = client.get(f"/m/{slug}/search", params={"q": "x" * 250})  # a link typed by hand: the page, kept
    assert page.status_code == 400 and "<h1>Search" in page.text
    assert f'name="q" value="{"x" * 200}"' in page.text
    slot = re.search(r'<span class="field-error" id="q-error" role="alert">(.*?)</span>', page.text)
    assert slot.group(1) == "q: String should have at most 200 characters"
    body = client.get(f"/m/{slug}/search.json", params={"q": "x" * 250})
    assert body.status_code == 400
    message = "q: String should have at most 200 characters"
    assert body.json() == {"ok": False, "error": message, "status": 400}


def test_an_error_page_links_back_to_the_page_before(serve, slug):
    client = serve()
    came_from = f"http://testserver/m/{slug}/layers/1"
    page = client.get(f"/m/{slug}/layers/99", headers={"Referer": came_from}).text
    assert f'<a id="back" href="{came_from}">Back to the page you came from</a>' in page
    elsewhere = client.get(f"/m/{slug}/layers/99", headers={"Referer": "https://example.com/"}).text
    assert 'id="back"' not in elsewhere  # only a page of this site


# ---- small ones ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "limit", "shown"),
    [
        ("short enough", 20, "short enough"),
        ("The quick brown fox jumps over the lazy dog", 20, "…over the lazy dog"),
        ("x" * 30, 10, "…" + "x" * 9),  # one long word: cut where it must be
    ],
)
def test_prefixes_are_cut_at_a_word_boundary(text, limit, shown):
    assert tail_words(text, limit) == shown and len(tail_words(text, limit)) <= limit


def summary(layer: int, positive_share: float) -> LayerSummary:
    return LayerSummary(
        layer=layer, keys=10, positive_share=positive_share, density=0.1, max_coefficient=1.0, max_prob=0.2,
        mean_max_prob=0.1, agreement_rate=0.0, agreeing_keys=0, value_norm=1.0,
    )  # fmt: skip


def test_the_model_charts_have_honest_axes():
    layers = [summary(layer, 0.498 + layer * 0.0002) for layer in range(30)]
    share = layer_lines(layers, "positive_share")["layout"]
    assert share["yaxis"]["range"] == [0, 1]  # noise near 50% stays flat
    assert share["shapes"][0]["y0"] == 0.5
    assert share["xaxis"]["range"] == [-0.5, 29.5] and share["xaxis"]["dtick"] == 5
    agreement = layer_lines(layers, "agreement_rate")["layout"]
    assert agreement["yaxis"]["range"][0] == 0 and agreement["yaxis"]["tickformat"] == ".1%"
    assert layer_lines(layers[:3], "density")["layout"]["xaxis"]["dtick"] == 1


def test_the_analysis_charts_label_their_log_axis_and_keep_the_paper_visible():
    def figure(unit, paper):
        return AnalysisFigure(
            name="f", title="t", text="", unit=unit, layers=[0, 1], depth=[0.0, 1.0],
            series={"ours": [0.5, 0.5]}, paper=paper,
        )  # fmt: skip

    ranks = figure("rank", {}).model_copy(update={"series": {"q0.5": [3.0, 17_000.0, None]}})
    rank = analysis_chart(ranks)["layout"]["yaxis"]
    assert rank["type"] == "log"
    assert rank["tickvals"] == [2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]
    assert rank["ticktext"][-3:] == ["5,000", "10,000", "20,000"]  # every label in full, none ambiguous
    band = analysis_chart(
        figure("share", {"paper: low end": [[0, 0.1], [1, 0.1]], "paper: high end": [[0, 0.5], [1, 0.5]]})
    )["data"]
    assert [trace["name"] for trace in band] == ["paper: low end", "paper: high end", "ours"]  # ours on top
    assert band[1]["fill"] == "tonexty" and band[0]["line"]["width"] > 2  # a band, wide enough to show


def test_uploads_go_to_the_data_folder_of_the_database_not_the_working_directory(tmp_path, monkeypatch):
    """Issue 39: with no upload folder set, an upload goes to `corpora` in the data folder, the SQLite
    database's (`ffmem serve --db sqlite:////srv/data/ffmem.db` started anywhere), and is offered there;
    nothing is written under the server's working directory."""
    from ffmem.store.db import upgrade

    monkeypatch.delenv("FFMEM_UPLOAD_DIR", raising=False)
    data = tmp_path / "srv" / "data"
    data.mkdir(parents=True)
    url = f"sqlite:///{data / 'ffmem.db'}"
    upgrade(url)
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    app = create_app(Settings(_env_file=None).model_copy(update={"database_url": url}))  # as serve --db
    with TestClient(app) as client:
        stored = upload(client, "notes.txt", b"One sentence.\n").json()["corpus"]
        assert stored["corpus"] == str(data.resolve() / "corpora" / f"{stored['sha256'][:12]}-notes.txt")
        assert [f["corpus"] for f in client.get("/corpora.json").json()["files"]] == [stored["corpus"]]
        assert f'<option value="{stored["corpus"]}">notes.txt</option>' in client.get("/").text
    app.state.engine.dispose()
    assert list(elsewhere.iterdir()) == []
