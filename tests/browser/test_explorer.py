"""The explorer in a real browser: Playwright driving Debian's Chromium (never a downloaded one),
against uvicorn serving the tiny index. Screenshots go to FFMEM_ARTIFACTS (default test-artifacts/).

Skipped when Chromium is not installed, except on CI (env CI set), where that is a failure.
"""

from __future__ import annotations

import pytest
from browser_fixtures import serving
from sqlalchemy import select

from ffmem.config import Settings
from ffmem.store import memory_reads
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import LanguageModel, Run, Token
from ffmem.web.main import create_app


@pytest.fixture(scope="module")
def server(explorer_db):
    """The explorer on a free local port, in a thread; yields its base URL."""
    app = create_app(Settings(database_url=explorer_db))
    with serving(app) as port:
        yield f"http://127.0.0.1:{port}"
    app.state.engine.dispose()


@pytest.fixture(scope="module")
def facts(explorer_db):
    """The model's slug and a token that some value promotes (to search for)."""
    engine = make_engine(explorer_db)
    with make_sessionmaker(engine)() as session:
        model = session.scalars(select(LanguageModel)).one()
        run_id = session.scalars(select(Run.id)).first()
        top = memory_reads.get_value_tokens(
            session=session, run_id=run_id, layer=0, key=0, readout="raw", direction=1
        )
        token_id = top[0].token_id
        text = session.get(Token, (model.id, token_id)).text
    engine.dispose()
    return {"slug": model.slug, "token": text}


def test_layer_page_then_key_page(page, server, facts):
    slug = facts["slug"]
    page.goto(f"{server}/m/{slug}/layers/1")
    rows = page.locator("table.keys tbody tr")
    assert rows.count() == 48
    page.locator("a.sort", has_text="max m").click()  # htmx swaps the table and pushes the URL
    page.wait_for_url("**sort=max_coefficient**")
    first = page.locator("table.keys tbody tr").first.locator("a.key").inner_text()
    page.locator("table.keys tbody tr").first.locator("a.key").click()
    page.wait_for_url(f"**/m/{slug}/layers/1/keys/{first}")
    # Every token of each trigger's sentence shaded by m, the trigger token outlined (issue 15).
    shaded = page.locator("table.triggers.positive .shaded")
    assert shaded.count() == 6 and page.locator("table.triggers.positive .stok.peak").count() == 6
    peak = page.locator("table.triggers.positive .stok.peak").first
    colour = peak.evaluate("e => getComputedStyle(e).backgroundColor")
    assert colour not in ("rgba(0, 0, 0, 0)", "transparent"), colour  # the strongest token is coloured
    assert peak.evaluate("e => getComputedStyle(e).outlineStyle") != "none"
    assert peak.get_attribute("title").startswith("m = ")
    page.locator("#samples").scroll_into_view_if_needed()  # examples across the range: loaded when seen
    page.wait_for_selector("#samples table.samples")
    samples = page.locator("#samples table.samples tbody tr")  # shaded too
    assert samples.count() >= 1 and page.locator("#samples .shaded").count() == samples.count()
    page.wait_for_selector("#value-chart-raw .main-svg")  # plotly drew the value chart
    assert page.locator("#value-chart-raw .bars path").count() >= 8
    page.wait_for_selector("#histogram-chart .main-svg")


def test_arrow_keys_walk_the_keys(page, server, facts):
    slug = facts["slug"]
    page.goto(f"{server}/m/{slug}/layers/0/keys/5")
    page.keyboard.press("ArrowRight")
    page.wait_for_url(f"**/m/{slug}/layers/0/keys/6")
    page.keyboard.press("ArrowLeft")
    page.wait_for_url(f"**/m/{slug}/layers/0/keys/5")
    assert page.locator("h1").inner_text().startswith("Layer 0, key 5")


def test_search_as_you_type_and_follow_a_result(page, server, facts):
    slug, token = facts["slug"], facts["token"]
    page.goto(f"{server}/m/{slug}/search")
    page.locator("#q").fill(token)
    page.wait_for_selector("a.result")
    page.wait_for_function("() => new URL(location.href).searchParams.get('q') !== null")
    assert page.evaluate("() => new URL(location.href).searchParams.get('q')") == token  # the URL reflects it
    href = page.locator("a.result").first.get_attribute("href")
    page.locator("a.result").first.click()
    page.wait_for_url(f"**{href}")
    assert page.locator("table.triggers").count() == 2


def test_hostile_corpus_text_stays_text(page, server, facts):
    page.goto(f"{server}/m/{facts['slug']}/search?q=script")
    assert page.locator("#results img").count() == 0
    sentences = page.locator("#results td.sentence").all_inner_texts()
    assert any("<script>alert(1)</script>" in s for s in sentences), sentences  # the characters it is


def test_search_marks_the_text_in_each_sentence_once(page, server, facts):
    page.goto(f"{server}/m/{facts['slug']}/search")
    page.locator("#q").fill("Capital OF")
    page.wait_for_selector("#sentence-matches mark")
    rows = page.locator("#sentence-matches tbody tr")
    texts = rows.locator("td.sentence").all_inner_texts()
    assert texts and len(texts) == len(set(texts)) == rows.count(), "each sentence once"
    assert page.locator("#sentence-matches mark").all_inner_texts() == ["capital of"] * len(texts)
    assert rows.first.locator("a.result").count() >= 1  # the keys it triggers, under it


def test_search_box_keeps_to_the_servers_limit(page, server, facts):
    page.goto(f"{server}/m/{facts['slug']}/search")
    page.locator("#q").fill("x" * 300)  # typing stops at maxlength
    assert len(page.locator("#q").input_value()) == 200


def test_weight_graph_and_explanation_on_the_key_page(watched, server, facts):
    """Issue 17's key-page views under the CSP: the weight graph drawn, its nodes and rows links to the
    memories they name; the automatic explanation shown and found by the search."""
    page, slug = watched, facts["slug"]
    page.goto(f"{server}/m/{slug}/layers/1/keys/3")
    page.locator("#related").scroll_into_view_if_needed()  # loaded when seen
    page.wait_for_selector("#weight-graph-chart .main-svg")  # plotly drew the graph
    inbound = page.locator("#weight-graph-in tbody a.result")
    outbound = page.locator("#weight-graph-out tbody a.result")
    assert inbound.count() == 10 and outbound.count() == 10  # layer 1 of 3: both ways, the top 10
    target = outbound.first.get_attribute("href")
    assert target.startswith(f"/m/{slug}/layers/2/keys/")
    # A click on a graph node opens its memory (static/charts.js reads the node's customdata[0]).
    page.evaluate(
        "url => document.getElementById('weight-graph-chart')"
        ".emit('plotly_click', {points: [{customdata: [url, '+1', '']}]})",
        target,
    )
    page.wait_for_url(f"**{target}")
    page.go_back()
    page.wait_for_selector("#explanation-text")
    text = page.locator("#explanation-text strong").inner_text()
    assert text and page.locator("#explanation-text .tag").inner_text() == "heuristic"
    word = max(text.replace("“", " ").replace("”", " ").replace(",", " ").split(), key=len)
    page.goto(f"{server}/m/{slug}/search")
    page.locator("#q").fill(word)
    page.wait_for_selector("#explanation-matches a.result")
    found = page.locator("#explanation-matches tbody tr td:nth-child(2)").all_inner_texts()
    assert found and all(word.lower() in row.lower() for row in found), (word, found)


def test_key_page_on_a_phone(page, server, facts):
    """Issue 26: at 390 px the sentence column of the triggers was ~100 px wide (a 23,000 px page). The
    triggers and samples are cards there: each sentence takes the page's width."""
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{server}/m/{facts['slug']}/layers/1/keys/3")
    page.locator("#samples").scroll_into_view_if_needed()
    page.wait_for_selector("#samples table.samples")
    for table in ("table.triggers.positive", "table.triggers.negative", "#samples table.samples"):
        cells = page.locator(f"{table} tbody td.sentence")
        assert cells.count() >= 1, table
        for box in (cells.nth(i).bounding_box() for i in range(cells.count())):
            assert box["width"] >= 0.8 * 390, (table, box)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the phone
    first = page.locator("table.triggers.positive tbody tr").first  # its rank, bar and next token above it
    sentence, rank = first.locator("td.sentence").bounding_box(), first.locator("td").first.bounding_box()
    assert rank["y"] + rank["height"] <= sentence["y"]
    # The outlined trigger token holds no leading space: a line never ends in an empty box.
    peaks = page.locator("table.triggers .stok.peak").evaluate_all(
        "els => els.map(e => e.childNodes[0].nodeValue || '')"
    )
    assert peaks and all(text == text.lstrip() or not text.strip() for text in peaks), peaks


GRAPH_LABELS = """() => {
  const chart = document.getElementById("weight-graph-chart");
  const box = (element) => {
    const r = element.getBoundingClientRect();
    return [r.left, r.top, r.right, r.bottom];
  };
  const labels = [...chart.querySelectorAll(".textpoint text")].map(box);
  return {chart: box(chart.querySelector(".main-svg")), labels: labels};
}"""


@pytest.mark.parametrize("width", [1280, 390])
def test_weight_graph_labels_fit_and_keep_apart(page, server, facts, width):
    """Issue 26: the graph's node labels lie inside the chart, none on another, on a laptop and a phone."""
    page.set_viewport_size({"width": width, "height": 900})
    page.goto(f"{server}/m/{facts['slug']}/layers/1/keys/3/related")
    page.wait_for_selector("#weight-graph-chart .main-svg .textpoint text")
    drawn = page.evaluate(GRAPH_LABELS)
    (left, top, right, bottom), labels = drawn["chart"], drawn["labels"]
    assert right <= width and len(labels) == 20  # the chart fits the page; every node labelled
    for x0, y0, x1, y1 in labels:
        assert left <= x0 and x1 <= right and top <= y0 and y1 <= bottom, (drawn["chart"], (x0, y0, x1, y1))
    for i, (x0, y0, x1, y1) in enumerate(labels):
        for a0, b0, a1, b1 in labels[i + 1 :]:
            assert x1 <= a0 or a1 <= x0 or y1 <= b0 or b1 <= y0, "two labels overlap"
    heading = page.locator("#weight-graph-key")  # the chart's title, as HTML: it wraps
    assert "L1 K3" in heading.inner_text() and heading.evaluate("e => e.scrollWidth <= e.clientWidth")


def test_a_wide_layer_on_a_phone_opens_any_page_and_any_key(page, server, facts):
    """Issue 29 (4): the page box goes to any page with the sort and page size kept, the key box to any key,
    and both fit a phone's width."""
    page.set_viewport_size({"width": 390, "height": 844})
    slug = facts["slug"]
    page.goto(f"{server}/m/{slug}/layers/1?sort=density&order=desc&per_page=5")
    for form in ("#open-key", "#page-jump"):
        box = page.locator(form).bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390, (form, box)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.locator("#page-jump input[name=page]").fill("4")
    page.locator("#page-jump button").click()
    page.wait_for_url("**page=4**")
    assert "page 4 of 10" in page.locator("#keys p.count").inner_text()
    assert "sort=density" in page.url and "order=desc" in page.url and "per_page=5" in page.url
    page.locator("#open-key input[name=key]").fill("7")
    page.locator("#open-key button").click()
    page.wait_for_url(f"**/m/{slug}/layers/1/keys/7**")
    assert page.locator("h1").first.inner_text().startswith("Layer 1")
