"""Labels: a person's pattern description and shallow/semantic tag of a memory, stored with their
history, shown on the key and layer pages, searchable; bad input is a 400 that changes nothing."""

from __future__ import annotations

import csv
import io
from datetime import datetime, timezone

import pytest
from fastapi.testclient import TestClient
from markupsafe import Markup, escape
from sqlalchemy import func, select

from ffmem.config import Settings
from ffmem.store.models import Label, LanguageModel
from ffmem.web.display import BIDI_CONTROLS
from ffmem.web.main import create_app
from ffmem.web.rendering import templates

# Both backends: labels are written, and searched by each backend's text index.
pytestmark = pytest.mark.backends("sqlite", "postgres")


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


def test_bidi_controls_in_a_label_do_not_reorder_the_pages(client, slug):
    """Issue 39: a label "\u202eevil\u202c" (a right-to-left override) read "live" on every page showing it.
    Every shown value loses the bidi controls (the templates' finalize); the JSON twin keeps the data."""
    pattern = "\u202eevil\u202c \u2067x\u2069 \u200e\u200f\u061cy \u202a\u202b\u202d."
    client.post(f"/m/{slug}/layers/1/keys/4/labels", data={"pattern": pattern, "author": "\u202emallory"})
    assert client.get(f"/m/{slug}/layers/1/keys/4.json").json()["label"]["pattern"] == pattern
    for url in (
        f"/m/{slug}/layers/1/keys/4",
        f"/m/{slug}/layers/1",
        f"/m/{slug}/labels",
        f"/m/{slug}/search?q=evil",
    ):
        page = client.get(url).text
        assert "evil x y ." in page, url
        assert not BIDI_CONTROLS.search(page), url
    assert "mallory" in client.get(f"/m/{slug}/labels").text


def test_every_shown_value_loses_bidi_controls_markup_kept():
    shown = templates.env.from_string('{{ text }}|{{ html }}|<i title="{{ text }}">{{ n }}</i>')
    html = Markup("<mark>\u2066a\u2069</mark>")
    rendered = shown.render(text="\u202edoc.exe<", html=html, n=3)
    assert rendered == 'doc.exe&lt;|<mark>a</mark>|<i title="doc.exe&lt;">3</i>'


def _labelled(db, slug) -> None:
    """Four labelled memories of the tiny model (L0 K3 labelled twice: its newest counts), at set times."""
    model_id = db.scalars(select(LanguageModel.id).where(LanguageModel.slug == slug)).one()
    rows = [  # (layer, key, pattern, tag, author, created_at), in the order they were written
        (0, 3, "old name", "", "ada", datetime(2025, 12, 31, 9, 0, tzinfo=timezone.utc)),
        (2, 9, "Years like 1969", "shallow", "ada", datetime(2026, 1, 3, 10, 0, tzinfo=timezone.utc)),
        (1, 4, "<script>alert(1)</script> & co", "", "", datetime(2026, 1, 2, 8, 30, tzinfo=timezone.utc)),
        (0, 10, "apples", "semantic", "bob", datetime(2025, 12, 30, 23, 59, 59, tzinfo=timezone.utc)),
        (0, 3, 'rivers, "quoted"', "semantic", "bob", datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)),
    ]
    for layer, key, pattern, tag, author, created_at in rows:
        db.add(Label(model_id=model_id, layer=layer, key=key, pattern=pattern, tag=tag, author=author,
                     created_at=created_at))  # fmt: skip
    db.commit()


LABEL_FIELDS = {"id", "layer", "key", "pattern", "tag", "author", "created_at", "url"}


def test_the_labels_index_lists_each_memorys_current_label_sorted(client, db, slug):
    """Issue 26 (16): /m/{model}/labels and its JSON twin, from one context: exact fields, the three sorts."""
    _labelled(db, slug)
    body = client.get(f"/m/{slug}/labels.json").json()
    assert set(body) == {"page", "title", "model", "sort", "sorts", "csv_url", "labels"}
    assert (body["page"], body["title"], body["model"], body["sort"]) == (
        "labels",
        f"{slug}: labels",
        slug,
        "key",
    )
    assert body["sorts"] == [
        {"name": "key", "title": "layer and key", "url": f"/m/{slug}/labels?sort=key"},
        {"name": "label", "title": "label", "url": f"/m/{slug}/labels?sort=label"},
        {"name": "date", "title": "newest first", "url": f"/m/{slug}/labels?sort=date"},
    ]
    assert body["csv_url"] == f"/m/{slug}/labels.csv?sort=key"
    first = body["labels"][0]
    assert set(first) == LABEL_FIELDS and isinstance(first["id"], int)
    assert first | {"id": None} == {
        "id": None, "layer": 0, "key": 3, "pattern": 'rivers, "quoted"', "tag": "semantic", "author": "bob",
        "created_at": "2026-01-01T12:00:00Z", "url": f"/m/{slug}/layers/0/keys/3",
    }  # fmt: skip

    def order(sort: str) -> list[tuple[int, int]]:
        labels = client.get(f"/m/{slug}/labels.json", params={"sort": sort}).json()["labels"]
        return [(label["layer"], label["key"]) for label in labels]

    assert order("key") == [(0, 3), (0, 10), (1, 4), (2, 9)]
    assert order("label") == [(1, 4), (0, 10), (0, 3), (2, 9)]  # "<script…", "apples", "rivers…", "Years…"
    assert order("date") == [(2, 9), (1, 4), (0, 3), (0, 10)]
    page = client.get(f"/m/{slug}/labels", params={"sort": "date"})
    assert page.status_code == 200
    assert (
        f'<link rel="alternate" type="application/json" href="/m/{slug}/labels.json?sort=date">' in page.text
    )
    assert '<strong aria-current="true">newest first</strong>' in page.text
    assert f'<a id="labels-csv" href="/m/{slug}/labels.csv?sort=date" download>' in page.text
    rows = page.text.split('id="labels"')[1].split("</table>")[0]
    assert [f'href="/m/{slug}/layers/{layer}/keys/{key}"' in rows for layer, key in order("date")] == [
        True
    ] * 4
    assert rows.index("L2 K9") < rows.index("L1 K4") < rows.index("L0 K3") < rows.index("L0 K10")
    model = client.get(f"/m/{slug}").text
    assert f'<a id="labels-link" href="/m/{slug}/labels">' in model


def test_a_label_with_html_in_it_is_escaped_on_the_labels_page(client, db, slug):
    _labelled(db, slug)
    page = client.get(f"/m/{slug}/labels").text
    assert "<script>alert(1)</script>" not in page
    assert "<td>&lt;script&gt;alert(1)&lt;/script&gt; &amp; co</td>" in page
    assert "<td>anonymous</td>" in page  # no author given


def test_the_labels_csv_export(client, db, slug):
    _labelled(db, slug)
    response = client.get(f"/m/{slug}/labels.csv", params={"sort": "label"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/csv; charset=utf-8"
    assert response.headers["content-disposition"] == f"attachment; filename*=UTF-8''{slug}-labels.csv"
    assert response.text == (
        "layer,key,pattern,tag,author,created_at,url\r\n"
        f"1,4,<script>alert(1)</script> & co,,,2026-01-02T08:30:00Z,/m/{slug}/layers/1/keys/4\r\n"
        f"0,10,apples,semantic,bob,2025-12-30T23:59:59Z,/m/{slug}/layers/0/keys/10\r\n"
        f'0,3,"rivers, ""quoted""",semantic,bob,2026-01-01T12:00:00Z,/m/{slug}/layers/0/keys/3\r\n'
        f"2,9,Years like 1969,shallow,ada,2026-01-03T10:00:00Z,/m/{slug}/layers/2/keys/9\r\n"
    )
    parsed = list(csv.DictReader(io.StringIO(response.text)))
    patterns = ["<script>alert(1)</script> & co", "apples", 'rivers, "quoted"', "Years like 1969"]
    assert [row["pattern"] for row in parsed] == patterns  # what a CSV reader reads back
    by_key = client.get(f"/m/{slug}/labels.csv").text.splitlines()
    assert [line.split(",")[:2] for line in by_key[1:]] == [["0", "3"], ["0", "10"], ["1", "4"], ["2", "9"]]


def test_the_labels_csv_opens_formulas_as_text(client, db, slug):
    """Issue 39: a text cell starting with = + - @, a tab or a carriage return gets a leading ' (OWASP's CSV
    injection advice), so a spreadsheet shows `=HYPERLINK(…)` as words; the layer and key stay numbers."""
    model_id = db.scalars(select(LanguageModel.id).where(LanguageModel.slug == slug)).one()
    when = datetime(2026, 1, 1, tzinfo=timezone.utc)
    rows = [  # (key, pattern, author)
        (1, '=HYPERLINK("http://evil.example","click")', "ada"),
        (2, "+1 more", "@bob"),
        (3, "-2 below", "\tcarol"),
        (4, "\rdan", "a=b, not a formula"),
    ]
    for key, pattern, author in rows:
        db.add(
            Label(
                model_id=model_id, layer=0, key=key, pattern=pattern, tag="", author=author, created_at=when
            )
        )
    db.commit()
    parsed = list(csv.reader(io.StringIO(client.get(f"/m/{slug}/labels.csv").text)))
    assert [row[:5] for row in parsed[1:]] == [
        ["0", "1", '\'=HYPERLINK("http://evil.example","click")', "", "ada"],
        ["0", "2", "'+1 more", "", "'@bob"],
        ["0", "3", "'-2 below", "", "'\tcarol"],
        ["0", "4", "'\rdan", "", "a=b, not a formula"],
    ]
    assert client.get(f"/m/{slug}/labels.json").json()["labels"][0]["pattern"] == rows[0][1]  # the data as is


def test_no_labels_yet(client, slug):
    body = client.get(f"/m/{slug}/labels.json").json()
    assert body["labels"] == []
    assert "has a label yet" in client.get(f"/m/{slug}/labels").text
    assert client.get(f"/m/{slug}/labels.csv").text == "layer,key,pattern,tag,author,created_at,url\r\n"


@pytest.mark.parametrize("path", ["labels", "labels.json", "labels.csv"])
def test_the_labels_of_an_unknown_model_are_a_404(client, slug, path):
    response = client.get(f"/m/no-such-model/{path}")
    assert response.status_code == 404
    message = f"There is no model 'no-such-model'. Known models: {slug}."
    if path.endswith(".json"):
        assert response.json() == {"ok": False, "error": message, "status": 404}
    else:
        assert "Unknown model" in response.text and escape(message) in response.text


@pytest.mark.parametrize("path", ["labels", "labels.json", "labels.csv"])
def test_a_bad_sort_is_a_400_in_the_error_shape(client, slug, path):
    response = client.get(f"/m/{slug}/{path}", params={"sort": "<b>size"})
    assert response.status_code == 400
    message = "sort: Input should be 'key', 'label' or 'date'"
    if path.endswith(".json"):
        assert response.json() == {"ok": False, "error": message, "status": 400}
    else:
        assert str(escape(message)) in response.text and "<b>size" not in response.text
