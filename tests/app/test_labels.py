"""Labels: a person's pattern description and shallow/semantic tag of a memory, stored with their
history, shown on the key and layer pages, searchable; bad input is a 400 that changes nothing."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from ffmem.config import Settings
from ffmem.store.models import Label
from ffmem.web.main import create_app


@pytest.fixture
def client(explorer_db, db):
    db.execute(Label.__table__.delete())  # each test starts unlabelled
    db.commit()
    app = create_app(Settings(database_url=explorer_db))
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


def test_label_a_memory_then_edit_it(client, db, slug):
    url = f"/m/{slug}/layers/1/keys/4/labels"
    first = client.post(
        url, data={"pattern": "ends with a city", "tag": "semantic", "author": "ada"}, follow_redirects=False
    )
    assert first.status_code == 303 and first.headers["location"] == f"/m/{slug}/layers/1/keys/4"
    second = client.post(
        f"{url}.json", data={"pattern": "  a capital city  ", "tag": "semantic", "author": "bob"}
    )
    assert second.status_code == 201
    assert second.json()["label"] | {"created_at": None, "id": None} == {
        "id": None, "pattern": "a capital city", "tag": "semantic", "author": "bob", "created_at": None
    }  # fmt: skip
    assert second.json()["history"] == 1
    key = client.get(f"/m/{slug}/layers/1/keys/4.json").json()
    assert key["label"]["pattern"] == "a capital city"
    assert [(h["pattern"], h["author"]) for h in key["label_history"]] == [("ends with a city", "ada")]
    page = client.get(f"/m/{slug}/layers/1/keys/4").text
    assert 'id="current-label"' in page and "a capital city" in page and "1 earlier label" in page
    rows = {
        row["key"]: row
        for row in client.get(f"/m/{slug}/layers/1.json", params={"per_page": 100}).json()["keys"]
    }
    assert rows[4]["label"]["pattern"] == "a capital city" and rows[5]["label"] is None
    assert db.scalar(select(func.count()).select_from(Label)) == 2


def test_labels_are_searchable(client, slug):
    client.post(f"/m/{slug}/layers/2/keys/9/labels", data={"pattern": "Years like 1969", "tag": "shallow"})
    client.post(f"/m/{slug}/layers/0/keys/3/labels", data={"pattern": "old: 100% numbers"})
    client.post(f"/m/{slug}/layers/0/keys/3/labels", data={"pattern": "rivers", "tag": "semantic"})
    hits = client.get(f"/m/{slug}/search.json", params={"q": "years"}).json()["labels"]
    assert [(h["layer"], h["key"], h["pattern"], h["tag"]) for h in hits] == [
        (2, 9, "Years like 1969", "shallow")
    ]
    assert hits[0]["url"] == f"/m/{slug}/layers/2/keys/9"
    assert (
        client.get(f"/m/{slug}/search.json", params={"q": "100%"}).json()["labels"] == []
    )  # only current labels
    assert [
        h["key"] for h in client.get(f"/m/{slug}/search.json", params={"q": "semantic"}).json()["labels"]
    ] == [3]


@pytest.mark.parametrize(
    ("path", "data", "status", "message"),
    [
        (
            "layers/1/keys/4/labels",
            {"pattern": "  ", "tag": ""},
            400,
            "Give a pattern description, a tag (shallow or semantic), or both.",
        ),
        (
            "layers/1/keys/4/labels",
            {"pattern": "x", "tag": "deep"},
            400,
            "tag: Input should be 'shallow', 'semantic' or ''",
        ),
        (
            "layers/1/keys/4/labels",
            {"pattern": "x" * 501},
            400,
            "pattern: String should have at most 500 characters",
        ),
        ("layers/9/keys/4/labels", {"pattern": "x"}, 404, None),
        ("layers/1/keys/999/labels", {"pattern": "x"}, 404, None),
    ],
)
def test_bad_labels_are_refused_and_store_nothing(client, db, slug, path, data, status, message):
    response = client.post(f"/m/{slug}/{path}.json", data=data)
    assert response.status_code == status and response.json()["ok"] is False
    if message:
        assert response.json()["error"] == message
    assert db.scalar(select(func.count()).select_from(Label)) == 0


def test_label_text_is_escaped(client, slug):
    client.post(
        f"/m/{slug}/layers/1/keys/4/labels",
        data={"pattern": "<script>alert(1)</script>", "author": '"><img src=x>'},
    )
    for url in (f"/m/{slug}/layers/1/keys/4", f"/m/{slug}/layers/1", f"/m/{slug}/search?q=script"):
        page = client.get(url).text
        assert "<script>alert(1)</script>" not in page and "<img src=x>" not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
