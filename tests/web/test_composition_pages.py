"""The key page's weight graph and automatic explanation, and explanations in the search, on the tiny
index (SQLite and Postgres): the JSON twin gives what the store holds, every graph node links to its
memory, and the search finds a memory by a word of its explanation."""

from __future__ import annotations

import json
import re
from html import unescape

import numpy as np
import pytest
from markupsafe import escape
from sqlalchemy import select

from ffmem.store import composition, key_examples, vocabularies
from ffmem.store.models import Explanation
from ffmem.web import urls
from ffmem.web.display import number, visible
from ffmem.web.pages.composition import NODE_LABEL_PX, LinkView, WeightGraphView, weight_graph


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


def test_the_weight_graph_keeps_its_labels_apart_and_inside():
    """Issue 26: labels cut at the chart's edges ("L29 K28" for L29 K287) and on top of each other. Each link
    has its own row; a writer's label sits left of it, a reader's right, into margins as wide as the
    longest label there; the page heads the chart (a plotly title does not wrap on a phone)."""

    def links(layers: list[int], key: int) -> list[LinkView]:
        return [
            LinkView(layer=at, key=key, score=0.1, url=f"/m/x/layers/{at}/keys/{key}", explanation=None)
            for at in layers
        ]

    graph = WeightGraphView(inbound=links([0, 14, 14], 1073), outbound=links([29, 16, 29, 29], 287))
    figure = weight_graph(graph, 15, 287, 30)
    nodes = next(trace for trace in figure["data"] if trace.get("text"))
    assert nodes["text"][:4] == ["L0 K1073", "L14 K1073", "L14 K1073", "L29 K287"]  # in full
    assert nodes["textposition"] == ["middle left"] * 3 + ["middle right"] * 4  # away from the centre
    assert nodes["cliponaxis"] is False  # into the margin beside the axis
    for side in (nodes["y"][:3], nodes["y"][3:]):
        assert len(set(side)) == len(side)  # one writer and one reader a row
    layout = figure["layout"]
    assert layout["margin"]["l"] >= NODE_LABEL_PX * len("L14 K1073") + nodes["marker"]["size"] / 2
    assert layout["margin"]["r"] >= NODE_LABEL_PX * len("L29 K287") + nodes["marker"]["size"] / 2
    assert layout["xaxis"]["range"] == [-0.5, 29.5] and layout["title"]["text"] == ""
    centre = figure["data"][-1]
    assert "text" not in centre and "L15 K287" in centre["hovertemplate"]  # the page names it
    assert not any(trace.get("text") for trace in figure["data"][:-2])  # edges carry no labels
    first = weight_graph(WeightGraphView(inbound=[], outbound=links([1], 5)), 0, 3, 30)["layout"]
    assert first["margin"]["l"] < first["margin"]["r"]  # no writers: no room kept for their labels


def test_the_weight_graph_hover_names_the_node_its_score_and_its_explanation_wrapped():
    """Issue 39 (1): the hover showed the explanation on one clipped line with a ␣ for every space. Now: who
    feeds whom, the score, and the explanation with its spaces, escaped, in lines of at most 60 characters
    (at most three, the last cut with …)."""
    words = "fires on “ Paris”, “ London” & <b>capitals</b> of countries in Europe, after “the capital of”"
    long = words + " and also on many more tokens that a hover has no room for at all"

    def link(layer: int, key: int, score: float, explanation: str | None) -> LinkView:
        url = f"/m/x/layers/{layer}/keys/{key}"
        return LinkView(layer=layer, key=key, score=score, url=url, explanation=explanation)

    graph = WeightGraphView(
        inbound=[link(3, 17, 0.25, words)], outbound=[link(9, 4, -1.5, long), link(8, 2, 1, None)]
    )
    nodes = next(trace for trace in weight_graph(graph, 5, 6, 12)["data"] if trace.get("customdata"))
    assert (
        nodes["hovertemplate"]
        == "%{customdata[1]}<br>score %{customdata[2]}<br>%{customdata[3]}<extra></extra>"
    )
    assert nodes["customdata"] == [
        [
            "/m/x/layers/3/keys/17",
            "L3 K17 → this key",
            "+0.25",
            "fires on “ Paris”, “ London” &amp; &lt;b&gt;capitals&lt;/b&gt; of countries<br>"
            "in Europe, after “the capital of”",
        ],
        [
            "/m/x/layers/9/keys/4",
            "this value → L9 K4",
            "-1.5",
            "fires on “ Paris”, “ London” &amp; &lt;b&gt;capitals&lt;/b&gt; of countries<br>"
            "in Europe, after “the capital of” and also on many more<br>"
            "tokens that a hover has no room for at all",
        ],
        ["/m/x/layers/8/keys/2", "this value → L8 K2", "+1", "not explained"],
    ]
    longer = WeightGraphView(inbound=[], outbound=[link(9, 4, 1, long + " " + long)])
    prose = next(t for t in weight_graph(longer, 5, 6, 12)["data"] if t.get("customdata"))["customdata"][0][3]
    lines = unescape(prose).split("<br>")
    assert len(lines) == 3 and lines[-1].endswith(" …") and all(len(line) <= 60 for line in lines), lines


def test_layer_zero_reads_no_earlier_memory(client, slug):
    body = client.get(f"/m/{slug}/layers/0/keys/0/related.json").json()
    assert body["weight_graph"]["inbound"] == [] and len(body["weight_graph"]["outbound"]) == 10
    assert "layer 0 reads no earlier memory" in client.get(f"/m/{slug}/layers/0/keys/0/related").text


def test_the_explanation_shows_beside_the_label(client, db, run, slug):
    stored = db.get(Explanation, (run.id, 2, 3))
    body = client.get(f"/m/{slug}/layers/2/keys/3.json").json()
    pattern = composition.explanation_pattern(stored)
    sign = pattern["sign"]
    texts = vocabularies.vocabulary(session=db, model_id=run.model_id)
    assert body["explanation"] == {
        "text": stored.text,
        "source": "heuristic",
        "score": stored.score,  # scored on the held-out sentence (index 9 of the tiny index's 16)
        "auroc": stored.details["auroc"],
        "positions": stored.details["positions"],
        "matches": stored.details["matches"],
        "protocol": stronger(stored.details) | {"simulation": None},  # no local explainer: not simulated
        "polarities": [  # the stronger side's text stored once, as the row's
            side | {"text": side.get("text", stored.text), "scores": side["scores"] | {"simulation": None}}
            for side in stored.details["polarities"]
        ],
        "quadrants": [  # the tiny Llama's FF is gated: each quadrant with examples, described and scored
            quadrant | {"scores": quadrant["scores"] | {"simulation": None}}
            for quadrant in stored.details["quadrants"]
        ],
        "table": {  # the pattern the score measured, its tokens' texts, in m's units, strongest first
            "sign": pattern["sign"],
            "tokens": strongest_first(
                {
                    "token_id": t,
                    "token": texts[t],
                    "previous_id": None,
                    "previous": None,
                    "weight": sign * w,
                }
                for t, w in zip(pattern["final"], pattern["weights"], strict=True)
            ),
            "pairs": strongest_first(
                {
                    "token_id": t,
                    "token": texts[t],
                    "previous_id": p,
                    "previous": texts.get(p, ""),
                    "weight": sign * w,
                }
                for (p, t), w in zip(pattern["pairs"], pattern["pair_weights"], strict=True)
            ),
        },
    }
    assert body["explanation"]["table"]["tokens"], "the tiny index's memory weighs some token"
    assert stored.details["positions"] > 0
    page = client.get(f"/m/{slug}/layers/2/keys/3").text
    # the first screen leads with the explanation (issue 42); people's label follows in triage order
    assert page.index('id="explanation"') < page.index('id="label"')
    assert '<details id="explanation-table">' in page and page.count(
        "<tr>", page.index("explanation-table")
    ) >= len(pattern["final"])
    shown = re.search(r'id="explanation-text"><strong>(.*?)</strong>', page, re.S).group(1)
    assert unescape(shown) == stored.text
    assert [side["sign"] for side in stored.details["polarities"]] == [1, -1]
    assert "text" not in next(s for s in stored.details["polarities"] if s["sign"] == stored.details["sign"])
    for side in body["explanation"]["polarities"]:  # each side's scores beside their controls
        name = "positive" if side["sign"] > 0 else "negative"
        assert unescape(visible_text(page, f'id="polarity-{name}"')).count(side["text"]) == 1
        table = page[page.index(f'id="scores-{name}"') :]
        cells = re.findall(r'<td class="num">([^<]*)</td>', table[: table.index("</table>")])
        got = side["scores"]
        assert cells == [
            number(got[n], 3)
            for n in ("pooled", "pooled_control", "random", "random_control", "auroc", "auroc_control")
        ]


def test_the_key_page_gives_each_quadrant_its_description_and_scores(client, db, run, slug):
    """A gated memory's quadrants under its polarities: each one's description (escaped: the tiny corpus
    holds markup) and its pooled, random-only and AUROC scores each beside its control, as the JSON twin
    and the store give them."""
    rows = db.scalars(select(Explanation).where(Explanation.run_id == run.id)).all()
    assert all(row.details["quadrants"] for row in rows)  # every memory of the gated model has some
    marked = [  # memories whose quadrant descriptions quote the corpus's markup
        row for row in rows if any("<" in q["text"] or '"' in q["text"] for q in row.details["quadrants"])
    ]
    for stored in [*marked[:1], db.get(Explanation, (run.id, 2, 3))]:
        url = f"/m/{slug}/layers/{stored.layer}/keys/{stored.key}"
        shown = client.get(f"{url}.json").json()["explanation"]["quadrants"]
        assert [q["quadrant"] for q in shown] == [q["quadrant"] for q in stored.details["quadrants"]]
        assert {q["quadrant"] for q in shown} <= {"pp", "pn", "np", "nn"}
        page = client.get(url).text
        section = page[
            page.index('id="explanation-quadrants"') : page.index(
                "</ul>", page.index("explanation-quadrants")
            )
        ]
        assert page.index('id="explanation-polarities"') < page.index('id="explanation-quadrants"')
        summary = section[section.index("<summary>") : section.index("</summary>")]  # one line, folded
        assert re.sub(r"<[^>]+>", "", summary).endswith(
            " · ".join(
                f"{q['quadrant']} {number(s['pooled'], 3)} ({number(s['pooled_control'], 3)})"
                for q in shown
                for s in [q["scores"]]
            )
        )
        for q in shown:
            item = section[section.index(f'id="quadrant-explanation-{q["quadrant"]}"') :]
            item = item[: item.index("</li>")]
            assert str(escape(q["text"])) in item and ("<" not in q["text"] or q["text"] not in item)
            s = q["scores"]
            assert (
                f"pooled {number(s['pooled'], 3)} (control {number(s['pooled_control'], 3)})"
                f" · random {number(s['random'], 3)} ({number(s['random_control'], 3)})"
                f" · AUROC {number(s['auroc'], 3)} ({number(s['auroc_control'], 3)})"
            ) in item
    assert marked, "the tiny corpus's markup reaches some quadrant's description"


def stronger(details: dict) -> dict:
    """The stored scores of a memory's stronger side."""
    return next(side["scores"] for side in details["polarities"] if side["sign"] == details["sign"])


def visible_text(page: str, anchor: str) -> str:
    """The element's text from `anchor` to its closing div, tags dropped."""
    part = page[page.index(anchor) :]
    return re.sub(r"<[^>]+>", "", part[: part.index("</div>")])


def strongest_first(rows) -> list[dict]:
    return sorted(rows, key=lambda row: -abs(row["weight"]))


def test_the_token_table_speaks_as_the_description_strongest_first(client, db, run, slug):
    """Issue 39: the key page's token table listed its weights in the stored order and in units of −m for a
    memory whose strong side is negative, while the description above named them in m's units. The table
    now gives every weight as the description does (sign · stored), by |weight|, the largest first."""
    explained = db.scalars(select(Explanation).where(Explanation.run_id == run.id)).all()
    negative = next(
        e
        for e in explained
        if (p := composition.explanation_pattern(e))["sign"] == -1 and len(p["final"]) > 2
    )
    pattern = composition.explanation_pattern(negative)
    table = client.get(f"/m/{slug}/layers/{negative.layer}/keys/{negative.key}.json").json()["explanation"]
    table = table["table"]
    weights = [row["weight"] for row in table["tokens"]]
    assert sorted(weights) == sorted(-w for w in pattern["weights"])  # m's units: −1 · the stored weight
    assert [abs(w) for w in weights] == sorted((abs(w) for w in weights), reverse=True)
    pairs = [abs(row["weight"]) for row in table["pairs"]]
    assert pairs == sorted(pairs, reverse=True)
    assert negative.text.startswith("Goes negative on “")
    clause = negative.text.split(";")[0].split(", not on")[0]  # the tokens it goes negative on
    named = re.findall(r"“(.*?)”", clause)
    lowering = {
        visible(row["token"], spaces=False) for row in table["tokens"] + table["pairs"] if row["weight"] < 0
    }
    lowering |= {visible(row["previous"], spaces=False) for row in table["pairs"] if row["weight"] < 0}
    assert named and set(named) <= lowering  # m < 0 at the tokens it names, as the table says
    page = client.get(f"/m/{slug}/layers/{negative.layer}/keys/{negative.key}").text
    section = page[page.index('<details id="explanation-table">') :]
    shown = re.findall(r'<td class="num">([^<]*)</td>', section[: section.index("</table>")])
    assert shown[len(table["pairs"]) :] == [number(w, 3) for w in weights]  # the page in the same order
    assert "−m" not in section


def test_the_search_finds_memories_by_their_explanation(client, db, run, slug):
    explained = db.scalars(
        select(Explanation).where(Explanation.run_id == run.id).order_by(Explanation.layer, Explanation.key)
    )
    stored, ngram = next(  # the first token an explanation names with two characters or more
        (e, found.group(1))
        for e in explained
        for found in [re.search(r"on “([^”]+)”", e.text)]
        if found and len(found.group(1).strip()) >= 2  # the search looks for texts of two characters or more
    )
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
        "protocol",
        "polarities",
        "quadrants",
    }
    page = client.get(f"/m/{slug}/search", params={"q": ngram, "run": run.id}).text
    assert 'id="explanation-matches"' in page and f'href="{urls.key_url(slug, *found[0])}"' in page


def test_the_layer_table_sorts_by_the_explanations_score_beside_its_control(client, db, run, slug):
    stored = {
        e.key: e
        for e in db.scalars(select(Explanation).where(Explanation.run_id == run.id, Explanation.layer == 1))
    }
    body = client.get(f"/m/{slug}/layers/1.json", params={"sort": "explanation", "order": "desc"}).json()
    shown = [(k["key"], k["explanation_score"], k["explanation_control"]) for k in body["keys"]]
    expected = sorted(stored.values(), key=lambda e: (e.score is None, -(e.score or 0), e.key))
    assert shown == [(e.key, e.score, stronger(e.details)["pooled_control"]) for e in expected[: len(shown)]]
    ascending = client.get(f"/m/{slug}/layers/1.json", params={"sort": "explanation", "order": "asc"}).json()
    scores = [k["explanation_score"] for k in ascending["keys"] if k["explanation_score"] is not None]
    assert scores == sorted(scores)
    page = client.get(f"/m/{slug}/layers/1", params={"sort": "explanation", "order": "desc"}).text
    first = body["keys"][0]
    assert f'{number(first["explanation_score"], 3)}<br><small class="control"' in page


def test_the_model_page_gives_each_layers_explanation_quartiles_with_their_controls(client, db, run, slug):
    """The explanations step's quartiles per layer, recomputed here from the stored rows: each memory's
    stronger side, its pooled score and its control's."""
    body = client.get(f"/m/{slug}.json").json()["explanations"]
    rows = db.scalars(select(Explanation).where(Explanation.run_id == run.id)).all()
    assert body["top_records"] == 20 and body["held_out_sentences"] > 0
    for layer in body["layers"]:
        mine = [stronger(e.details) for e in rows if e.layer == layer["layer"]]
        for name in ("pooled", "pooled_control", "random", "auroc"):
            values = np.array([p[name] for p in mine if p[name] is not None])
            expected = (
                [round(float(q), 4) for q in np.quantile(values, [0.25, 0.5, 0.75])] if values.size else None
            )
            assert layer[name] == pytest.approx(expected, abs=1e-4), (layer["layer"], name)
    page = client.get(f"/m/{slug}").text
    assert 'id="explanation-score-table"' in page and "fewer than 0.4%" in page


def test_the_model_page_gives_each_quadrants_medians_with_their_controls(client, db, run, slug):
    """A gated run explained per quadrant: each quadrant's medians over the memories scored in it, all
    layers and per depth third, recomputed here from the stored rows' quadrants, and drawn as a table."""
    body = client.get(f"/m/{slug}.json").json()["explanations"]
    rows = db.scalars(select(Explanation).where(Explanation.run_id == run.id)).all()
    n_layers = len(body["layers"])
    thirds = [set(part.tolist()) for part in np.array_split(np.arange(n_layers), 3)]

    def expected(quadrant: str, name: str, layers) -> float | None:
        values = np.array(
            [
                q["scores"][name]
                for e in rows
                if e.layer in layers
                for q in e.details.get("quadrants", [])
                if q["quadrant"] == quadrant and q["scores"][name] is not None
            ]
        )
        return round(float(np.median(values)), 4) if values.size else None

    assert [q["quadrant"] for q in body["quadrants"]] == ["pp", "pn", "np", "nn"]
    for shown in body["quadrants"]:
        for name in ("pooled", "random", "auroc"):
            want = expected(shown["quadrant"], name, set(range(n_layers)))
            assert shown[name]["all"] == pytest.approx(want, abs=1e-4), (shown["quadrant"], name)
            assert shown[name]["thirds"] == pytest.approx(
                [expected(shown["quadrant"], name, part) for part in thirds], abs=1e-4
            )
    assert body["quadrants"][0]["pooled"]["all"] is not None, "the tiny index scores its pp quadrants"
    page = client.get(f"/m/{slug}").text
    table = page[page.index('id="quadrant-score-table"') :]
    table = table[: table.index("</table>")]
    pp = body["quadrants"][0]
    first_row = table[table.index("<td>pp</td>") :]
    assert f"<strong>{number(pp['pooled']['all'], 2)}</strong>" in first_row.split("</tr>")[0]
    assert table.count("<tr>") == 1 + 4  # the header and a row per quadrant


def test_the_quadrant_examples_are_read_for_the_explanations_only_when_asked(db, run):
    """A run explained without `explain_quadrants` (the default) never decodes a key's quadrant examples."""
    asked = key_examples.layer_shading(session=db, run_id=run.id, layer=2, quadrants=True)
    unasked = key_examples.layer_shading(session=db, run_id=run.id, layer=2)
    assert asked.keys() == unasked.keys() and any(stored.quadrants for stored in asked.values())
    assert all(stored.quadrants is None for stored in unasked.values())
