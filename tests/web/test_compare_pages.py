"""Two runs side by side on the tiny index (SQLite and Postgres): the page of a pair before and after its
comparison job, its JSON twin's exact fields, either order of the runs, links to both runs' key pages,
the model page's form, and bad run ids or runs of other shapes refused in the one error shape."""

from __future__ import annotations

import json
import re
from html import unescape

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from ffmem.config import Settings
from ffmem.store import comparison
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import LanguageModel, Run
from ffmem.web import urls
from ffmem.web.main import create_app
from ffmem.worker.index import IndexOptions
from ffmem.worker.loop import Worker, build_index

# Both backends: runs and comparison jobs are written.
pytestmark = pytest.mark.backends("sqlite", "postgres")

CONTEXT_FIELDS = {
    "page", "title", "model", "a", "b", "status", "job", "compared", "sort", "sorts", "limit", "layer",
    "layers", "keys", "choices", "start_url",
}  # fmt: skip
KEY_FIELDS = {
    "layer", "key", "overlap", "negative_overlap", "key_cosine", "gate_cosine", "up_cosine", "value_cosine",
    "moved", "d_mean", "d_positive_share", "d_max_coefficient", "d_min_coefficient", "d_density", "url_a",
    "url_b",
}  # fmt: skip
RUN_FIELDS = {"id", "model", "corpus", "n_sentences", "top_k", "weights_sha256", "url"}
LAYER_FIELDS = {
    "layer", "mean_overlap", "mean_negative_overlap", "mean_key_cosine", "mean_value_cosine",
    "triggers_changed",
}  # fmt: skip
COMPARED_FIELDS = {
    "basis",
    "triggers",
    "top_t",
    "overlap",
    "keys",
    "values",
    "statistics",
    "same_weights",
    "seconds",
}
ERROR_KEYS = {"ok", "error", "status"}


@pytest.fixture(scope="module")
def runs(explorer_db, tiny, tiny_model_dir, tmp_path_factory) -> tuple[int, int, int]:
    """(the explorer's run, the same corpus mined in shards of 3, a run of a model of another shape)."""
    engine = make_engine(explorer_db)
    sessions = make_sessionmaker(engine)
    with sessions() as session:
        first = session.scalars(select(Run).order_by(Run.id)).first()
        corpus = first.corpus.source
    folder = tmp_path_factory.mktemp("second-run")
    settings = Settings(
        model=str(tiny_model_dir), corpus=corpus, sentences=None, top_k=6, device="cpu", dtype="float32",
        batch_tokens=128, shard_sentences=3, value_tokens=8, cache_dir=folder / "cache",
    )  # fmt: skip
    options = IndexOptions.from_settings(settings, progress=False)
    second = build_index(options, sessions, loaded=tiny).run_id
    with sessions() as session:  # a run of a wider model (its rows copied: only its shape matters here)
        first = session.get(Run, first.id)
        model = first.model
        columns = [c.name for c in LanguageModel.__table__.columns if c.name not in ("id", "slug", "n_keys")]
        wider = LanguageModel(
            slug="wider-llama", n_keys=model.n_keys * 2, **{name: getattr(model, name) for name in columns}
        )
        session.add(wider)
        session.flush()
        columns = [c.name for c in Run.__table__.columns if c.name not in ("id", "model_id")]
        other = Run(model_id=wider.id, **{name: getattr(first, name) for name in columns})
        session.add(other)
        session.commit()
        ids = (first.id, second, other.id)
    engine.dispose()
    return ids


@pytest.fixture(scope="module")
def slug(explorer_db) -> str:
    """The tiny model's URL name (this module adds another model)."""
    engine = make_engine(explorer_db)
    with make_sessionmaker(engine)() as session:
        found = session.scalars(select(Run).order_by(Run.id)).first().model.slug
    engine.dispose()
    return found


@pytest.fixture(scope="module")
def client(explorer_db, runs):
    app = create_app(Settings(database_url=explorer_db))
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


def work(explorer_db, tmp_path) -> None:
    """Let a worker do every queued job."""
    engine = make_engine(explorer_db)
    settings = Settings(model="unused", device="cpu", dtype="float32", cache_dir=tmp_path)
    options = IndexOptions.from_settings(settings, progress=False)
    Worker(make_sessionmaker(engine), options).work(once=True, poll_seconds=0.05)
    engine.dispose()


def test_a_pair_is_queued_then_shown(client, runs, slug, explorer_db, tmp_path):
    first, second, _ = runs
    missing = client.get(f"/m/{slug}/compare.json?a={first}&b={second}").json()
    assert set(missing) == CONTEXT_FIELDS
    assert missing["status"] == "missing" and missing["keys"] == [] and missing["job"] is None
    assert set(missing["a"]) == RUN_FIELDS and missing["b"]["id"] == second
    page = client.get(f"/m/{slug}/compare?a={first}&b={second}").text
    assert 'id="start-comparison"' in page and f'action="{urls.start_compare_url(slug)}"' in page

    queued = client.post(f"/m/{slug}/compare.json", data={"a": first, "b": second})
    assert queued.status_code == 201
    assert queued.json()["status"] == "queued" and queued.json()["job"]["kind"] == "comparison"
    again = client.post(f"/m/{slug}/compare", data={"a": second, "b": first}, follow_redirects=False)
    assert again.status_code == 303 and again.headers["location"] == urls.compare_url(slug, a=second, b=first)
    assert (
        client.get(f"/m/{slug}/compare.json?a={second}&b={first}").json()["job"]["id"]
        == queued.json()["job"]["id"]
    )
    page = client.get(f"/m/{slug}/compare?a={first}&b={second}").text
    assert 'hx-trigger="every 2s"' in page and urls.job_url(queued.json()["job"]["id"]) in page

    work(explorer_db, tmp_path)
    body = client.get(f"/m/{slug}/compare.json?a={first}&b={second}&limit=500").json()
    assert set(body) == CONTEXT_FIELDS and body["status"] == "done" and body["job"] is None
    assert set(body["compared"]) == COMPARED_FIELDS
    assert body["compared"]["basis"] == "sentences" and body["compared"]["top_t"] == 6
    assert body["compared"]["same_weights"] is True
    assert body["sort"] == "change" and set(body["sorts"]) == set(comparison.SORTS)
    assert len(body["keys"]) == 3 * 48 and len(body["layers"]) == 3
    for row in body["keys"]:
        assert set(row) == KEY_FIELDS
        assert row["overlap"] == 1.0 and row["negative_overlap"] == 1.0
        assert row["key_cosine"] == pytest.approx(1.0) and row["value_cosine"] == pytest.approx(1.0)
        assert row["url_a"] == urls.key_url(slug, row["layer"], row["key"], run=first)
        assert row["url_b"] == urls.key_url(slug, row["layer"], row["key"], run=second)
    for layer in body["layers"]:
        assert set(layer) == LAYER_FIELDS and layer["mean_overlap"] == 1.0 and layer["triggers_changed"] == 0

    # The other order: the same stored pair, its changes negated.
    reverse = client.get(f"/m/{slug}/compare.json?a={second}&b={first}&limit=500").json()
    assert (reverse["a"]["id"], reverse["b"]["id"]) == (second, first)
    forward = {(r["layer"], r["key"]): r for r in body["keys"]}
    for row in reverse["keys"]:
        for name in ("d_mean", "d_max_coefficient", "d_positive_share"):
            mirrored = forward[row["layer"], row["key"]][name]
            assert row[name] == (None if mirrored is None else -mirrored + 0.0)

    # One layer, another sort.
    layer = client.get(f"/m/{slug}/compare.json?a={first}&b={second}&layer=2&sort=mean&limit=5").json()
    assert [row["layer"] for row in layer["keys"]] == [2] * 5
    changes = [abs(row["d_mean"]) for row in layer["keys"]]
    assert changes == sorted(changes, reverse=True)
    # The sort form's empty layer box means every layer, as no layer does.
    assert client.get(f"/m/{slug}/compare.json?a={first}&b={second}&limit=500&layer=").json() == body

    page = client.get(f"/m/{slug}/compare?a={first}&b={second}").text
    assert 'id="key-changes"' in page and 'id="what-compared"' in page
    shown = body["keys"][0]
    assert f'href="{shown["url_a"]}"' in page.replace(
        "&amp;", "&"
    ) and f'href="{shown["url_b"]}"' in page.replace("&amp;", "&")
    figure = json.loads(unescape(re.search(r'id="chart-comparison" data-figure="([^"]*)"', page).group(1)))
    assert [trace["y"] for trace in figure["data"]] == [
        [layer["mean_overlap"] for layer in body["layers"]],
        [layer["mean_key_cosine"] for layer in body["layers"]],
        [layer["mean_value_cosine"] for layer in body["layers"]],
    ]
    twin = f"/m/{slug}/compare.json?a={first}&amp;b={second}"
    assert f'<link rel="alternate" type="application/json" href="{twin}">' in page


def test_pick_the_second_run_from_the_model_page(client, runs, slug):
    first, second, other = runs
    page = client.get(f"/m/{slug}?run={first}").text
    assert 'id="compare-runs"' in page and f'action="{urls.compare_url(slug)}"' in page
    body = client.get(f"/m/{slug}/compare.json?a={first}").json()
    assert body["status"] == "pick" and body["b"] is None
    assert [choice["id"] for choice in body["choices"]] == [second]  # not itself, not another shape
    assert body["choices"][0]["url"] == urls.compare_url(slug, a=first, b=second)
    assert 'id="pick-run"' in client.get(f"/m/{slug}/compare?a={first}").text


@pytest.mark.parametrize(
    ("query", "status", "words"),
    [
        ("b=999999", 404, "There is no run 999999."),
        ("b={first}", 400, "compared with itself"),
        ("b={other}", 400, "differ in shape"),
        ("a={other}&b={first}", 404, "has no run"),
        ("a=999999&b={first}", 404, "has no run 999999"),
        ("b={second}&sort=nonsense", 400, "sort"),
        ("b={second}&layer=3", 404, "no layer 3"),
        ("b={second}&layer=-1", 400, "layer: Input should be greater than or equal to 0"),
        ("b={second}&layer=x", 400, "layer: Input should be a valid integer"),
        ("b={second}&limit=0", 400, "limit"),
        ("b=abc", 400, "b"),
    ],
)
def test_bad_pairs_are_refused_in_the_error_shape(client, runs, slug, query, status, words):
    first, second, other = runs
    query = query.format(first=first, second=second, other=other)
    if not query.startswith("a="):
        query = f"a={first}&{query}"
    answer = client.get(f"/m/{slug}/compare.json?{query}")
    assert answer.status_code == status
    assert set(answer.json()) == ERROR_KEYS and answer.json()["status"] == status
    assert words in answer.json()["error"]
    assert client.get(f"/m/{slug}/compare?{query}").status_code == status


def test_queuing_a_pair_of_other_shapes_is_refused(client, runs, slug):
    first, _, other = runs
    answer = client.post(f"/m/{slug}/compare.json", data={"a": first, "b": other})
    assert answer.status_code == 400 and set(answer.json()) == ERROR_KEYS
    assert "differ in shape" in answer.json()["error"]
