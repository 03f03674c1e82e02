"""The key page's weight graph and automatic explanation, and explanations in the search, on the tiny
index (SQLite and Postgres): the JSON twin gives what the store holds, every graph node links to its
memory, and the search finds a memory by a word of its explanation."""

from __future__ import annotations

import json
import re
from html import unescape

from sqlalchemy import select

from ffmem.store import composition
from ffmem.store.models import Explanation
from ffmem.web import urls


def test_the_key_page_shows_who_feeds_whom(client, db, run, slug):
    key_page = client.get(f"/m/{slug}/layers/1/keys/5.json").json()
    assert "weight_graph" not in key_page  # the key page loads it as a section, from its own page
    assert key_page["links"]["related"] == f"/m/{slug}/layers/1/keys/5/related?run={run.id}"
    body = client.get(f"/m/{slug}/layers/1/keys/5/related.json").json()
    assert body["page"] == "related" and (body["layer"], body["key"], body["run"]["id"]) == (1, 5, run.id)
    stored = composition.get_links(session=db, run_id=run.id, layer=1, key=5)
    graph = body["weight_graph"]
    for direction, shown in (("in", graph["inbound"]), ("out", graph["outbound"])):
        assert [(m["layer"], m["key"], m["score"]) for m in shown] == [
            (link.layer, link.key, link.score) for link in stored[direction]
        ]
        assert len(shown) == 10
        assert all(m["url"] == urls.key_url(slug, m["layer"], m["key"]) for m in shown)
        assert all(m["explanation"] for m in shown)  # every memory of the run is explained
    assert {m["layer"] for m in graph["inbound"]} == {0} and {m["layer"] for m in graph["outbound"]} == {2}
    scores = [abs(m["score"]) for m in graph["inbound"]]
    assert scores == sorted(scores, reverse=True)

    loads = f'<div id="related" hx-get="{key_page["links"]["related"]}"'.replace("&", "&amp;")
    assert loads in client.get(f"/m/{slug}/layers/1/keys/5").text
    section = client.get(
        f"/m/{slug}/layers/1/keys/5/related", headers={"HX-Request": "1", "HX-Target": "related"}
    )
    assert "<html" not in section.text and section.text.count('<div id="related">') == 1
    page = client.get(f"/m/{slug}/layers/1/keys/5/related").text
    assert "<title>" in page and 'id="weight-graph-in"' in page and 'id="weight-graph-out"' in page
    figure = json.loads(unescape(re.search(r'id="weight-graph-chart" data-figure="([^"]*)"', page).group(1)))
    nodes = next(trace for trace in figure["data"] if trace.get("customdata"))
    assert [point[0] for point in nodes["customdata"]] == [
        m["url"] for m in graph["inbound"] + graph["outbound"]
    ]
    assert figure["layout"]["meta"] == {"links": True}
    for m in graph["inbound"][:3]:
        assert f'href="{m["url"]}"' in page


def test_layer_zero_reads_no_earlier_memory(client, slug):
    body = client.get(f"/m/{slug}/layers/0/keys/0/related.json").json()
    assert body["weight_graph"]["inbound"] == [] and len(body["weight_graph"]["outbound"]) == 10
    assert "layer 0 reads no earlier memory" in client.get(f"/m/{slug}/layers/0/keys/0/related").text


def test_the_explanation_shows_beside_the_label(client, db, run, slug):
    stored = db.get(Explanation, (run.id, 2, 3))
    body = client.get(f"/m/{slug}/layers/2/keys/3.json").json()
    assert body["explanation"] == {
        "text": stored.text,
        "source": "heuristic",
        "score": stored.score,  # scored on the held-out sentence (index 9 of the tiny index's 16)
        "auroc": stored.details["auroc"],
        "positions": stored.details["positions"],
        "matches": stored.details["matches"],
    }
    assert stored.details["positions"] > 0
    page = client.get(f"/m/{slug}/layers/2/keys/3").text
    assert page.index('id="label"') < page.index('id="explanation"')
    shown = re.search(r'id="explanation-text"><strong>(.*?)</strong>', page, re.S).group(1)
    assert unescape(shown) == stored.text
    held = f"{stored.details['positions']:,} held-out positions"
    assert (
        f"over {stored.details['positions']:,} positions of held-out" if stored.score is not None else held
    ) in page


def test_the_search_finds_memories_by_their_explanation(client, db, run, slug):
    stored = db.scalars(
        select(Explanation)
        .where(Explanation.run_id == run.id, Explanation.text.like("%ends with “%"))
        .order_by(Explanation.layer, Explanation.key)
    ).first()
    ngram = re.search(r"ends with “([^”]+)”", stored.text).group(1)
    assert len(ngram.strip()) >= 2  # the search looks for texts of two characters or more
    body = client.get(f"/m/{slug}/search.json", params={"q": ngram, "run": run.id, "limit": 200}).json()
    found = [(hit["layer"], hit["key"]) for hit in body["explanations"]]
    assert (stored.layer, stored.key) in found
    assert all(ngram.strip().lower() in hit["text"].lower() for hit in body["explanations"])
    assert set(body["explanations"][0]) == {
        "layer",
        "key",
        "url",
        "text",
        "source",
        "score",
        "auroc",
        "positions",
        "matches",
    }
    page = client.get(f"/m/{slug}/search", params={"q": ngram, "run": run.id}).text
    assert 'id="explanation-matches"' in page and f'href="{urls.key_url(slug, *found[0])}"' in page
