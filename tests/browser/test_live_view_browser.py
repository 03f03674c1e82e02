"""The live view (/m/{model}/trace) in a real browser: Playwright driving Debian's Chromium (never a
downloaded one), against uvicorn serving the explorer on the tiny index and a real live worker (its own
uvicorn, the tiny model preloaded on the CPU). Screenshots go to FFMEM_ARTIFACTS (default test-artifacts/).

Skipped when Chromium is not installed, except on CI (env CI set), where that is a failure.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest
from browser_fixtures import ARTIFACTS, serving
from sqlalchemy import select

from ffmem.config import Settings
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import LanguageModel
from ffmem.web.main import create_app
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

PROMPT = "The capital of France is"
HOSTILE = '<script>alert(1)</script> "><img src=x onerror=alert(1)>'
DEAD_WORKER = "http://127.0.0.1:9"  # nothing listens there: the explorer without a live worker


@pytest.fixture(scope="module")
def worker(tiny, tiny_model_dir):
    """The live worker holding the tiny model (the index's LanguageModel.source); yields its URL."""
    live = Live(device="cpu")
    live.models[str(tiny_model_dir)] = tiny
    with serving(create_live_app(live)) as port:
        yield f"http://127.0.0.1:{port}"
    live.executor.shutdown(wait=False)


@pytest.fixture(scope="module")
def server(explorer_db, worker):
    """The explorer asking that worker; yields its base URL."""
    app = create_app(Settings(database_url=explorer_db, worker_url=worker))
    with serving(app) as port:
        yield f"http://127.0.0.1:{port}"
    app.state.engine.dispose()


@pytest.fixture(scope="module")
def lonely_server(explorer_db):
    """The explorer with no live worker answering; yields its base URL."""
    app = create_app(Settings(database_url=explorer_db, worker_url=DEAD_WORKER, worker_timeout=5))
    with serving(app) as port:
        yield f"http://127.0.0.1:{port}"
    app.state.engine.dispose()


@pytest.fixture(scope="module")
def slug(explorer_db) -> str:
    engine = make_engine(explorer_db)
    with make_sessionmaker(engine)() as session:
        slug = session.scalars(select(LanguageModel.slug)).one()
    engine.dispose()
    return slug


def query(page) -> dict[str, list[str]]:
    """The current URL's query string, decoded."""
    return parse_qs(urlsplit(page.url).query, keep_blank_values=True)


def chips(page) -> list[str]:
    return page.locator("#trace .chips a.chip").all_inner_texts()


def run_trace(page, base: str, slug: str, text: str) -> None:
    """Open the empty live view, type `text` and press trace (htmx swaps the result into #trace)."""
    page.goto(f"{base}/m/{slug}/trace")
    assert page.locator("#layers").count() == 0
    page.locator("#prompt").fill(text)
    page.locator("#run-trace").click()
    page.wait_for_function("text => new URL(location.href).searchParams.get('text') === text", arg=text)
    page.wait_for_selector("#layers")


def test_type_a_prompt_and_trace_it(page, server, slug):
    run_trace(page, server, slug, PROMPT)
    assert page.locator("#layers > tbody > tr").count() == 3  # one row per layer of the tiny model
    assert page.locator("#layers > tbody > tr > td:first-child").all_inner_texts() == ["0", "1", "2"]
    page.wait_for_selector("#trace-heatmap .main-svg")  # plotly drew both charts after the swap
    page.wait_for_selector("#confidence-chart .main-svg")
    page.wait_for_selector("#trace-heatmap .heatmaplayer image", state="attached")  # a heatmap, not axes
    assert page.locator("#confidence-chart .scatterlayer .trace").count() >= 1
    assert "text=The+capital" in page.url or "text=The%20capital" in page.url
    assert query(page)["text"] == [PROMPT]
    tokens = chips(page)
    assert len(tokens) > 1
    assert "".join(tokens).replace("\u2423", " ") == PROMPT  # the chips spell the prompt (␣ for spaces)
    last = page.locator(f"#token-{len(tokens) - 1}")
    assert last.get_attribute("class").split() == ["chip", "selected"]
    assert page.locator("#trace .chips a.chip.selected").count() == 1
    assert f"After position {len(tokens) - 1} the model predicts" in page.locator("#trace").inner_text()


def test_click_a_token_chip_selects_it_without_a_reload(page, server, slug):
    run_trace(page, server, slug, PROMPT)
    last = len(chips(page)) - 1
    page.evaluate("() => { window.__marker = 1; }")
    page.locator("#token-1").click()
    page.wait_for_url("**position=1**")
    page.wait_for_selector("#token-1.selected")
    assert page.evaluate("() => window.__marker") == 1  # htmx swapped #trace: no full page load
    assert query(page)["position"] == ["1"]
    assert "selected" in page.locator("#token-1").get_attribute("class").split()
    assert "selected" not in page.locator(f"#token-{last}").get_attribute("class").split()
    assert page.locator("#trace .chips a.chip.selected").count() == 1
    assert "After position 1 the model predicts" in page.locator("#trace").inner_text()
    assert page.locator("#layers > tbody > tr").count() == 3
    page.wait_for_selector("#trace-heatmap .heatmaplayer image", state="attached")  # redrawn after the swap


def test_click_a_heatmap_column_selects_its_position(page, server, slug):
    run_trace(page, server, slug, PROMPT)
    page.wait_for_selector("#trace-heatmap .heatmaplayer image", state="attached")
    n = len(chips(page))
    plot = page.locator("#trace-heatmap .nsewdrag").first.bounding_box()  # the plot area, one column a token
    page.evaluate("() => { window.__marker = 1; }")
    page.mouse.click(plot["x"] + 2.5 * plot["width"] / n, plot["y"] + plot["height"] / 2)
    page.wait_for_url("**position=2**")
    page.wait_for_selector("#token-2.selected")
    assert page.evaluate("() => window.__marker") == 1
    assert page.locator("#trace .chips a.chip.selected").count() == 1


def test_switch_a_memory_off(page, server, slug):
    run_trace(page, server, slug, PROMPT)
    assert page.locator("#prediction thead th", has_text="p edited").count() == 0
    assert page.locator("#edits").count() == 0
    row = page.locator("#layers > tbody > tr").last
    details = row.locator("details")
    if details.get_attribute("open") is None:
        details.locator("summary").click()
    memory = details.locator("table.memories tr").filter(has=page.locator("a.off")).first
    name = memory.locator("td").first.inner_text()  # L2K…
    assert name.startswith("L2K"), name
    memory.locator("a.off").click()
    page.wait_for_url("**intervene=**")
    page.wait_for_selector("#edits")
    assert query(page)["intervene"] == [name]
    assert query(page)["text"] == [PROMPT]  # the edit keeps the prompt
    assert page.locator("#prediction thead th", has_text="p edited").count() == 1
    assert page.locator("#edits li").count() == 1
    assert page.locator("#edits li a").first.inner_text() == name
    assert page.locator("#intervene").input_value() == name  # the form shows the edit
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "live-view-edited.png"), full_page=True)


def test_hostile_prompt_stays_text(page, server, slug, dialogs):
    run_trace(page, server, slug, HOSTILE)
    page.wait_for_selector("#trace-heatmap .main-svg")
    assert "".join(chips(page)).replace("\u2423", " ") == HOSTILE  # shown as the characters it is
    assert page.locator("img").count() == 0
    assert page.locator("#trace script").count() == 0
    assert page.locator("#prompt").input_value() == HOSTILE
    page.reload()  # the same trace rendered as a full page from the pushed URL
    page.wait_for_selector("#trace-heatmap .main-svg")
    assert "".join(chips(page)).replace("\u2423", " ") == HOSTILE
    assert page.locator("img").count() == 0
    assert dialogs == []


def test_no_worker_says_so_and_browsing_goes_on(page, lonely_server, slug):
    page.goto(f"{lonely_server}/m/{slug}/trace")
    assert "down" in page.locator("#worker-status").inner_text()
    page.locator("#prompt").fill(PROMPT)
    page.locator("#run-trace").click()  # through htmx: the notice is swapped in
    notice = page.locator("#worker-notice")
    notice.wait_for()
    assert "no live worker answers" in notice.inner_text().lower()
    assert page.locator("#layers").count() == 0
    response = page.goto(f"{lonely_server}/m/{slug}/trace?text=The+capital+of+France+is")
    assert response.status == 503
    assert "no live worker answers" in page.locator("#worker-notice").inner_text().lower()
    assert page.locator("#prompt").input_value() == PROMPT  # the form keeps the prompt
    response = page.goto(f"{lonely_server}/m/{slug}/layers/0")
    assert response.status == 200
    assert page.locator("table.keys tbody tr").count() == 48


def test_an_edit_shows_the_edited_pass_and_what_it_was(page, server, slug):
    """Issue 13: with edits the table, the summary and the charts are the edited pass's, the unedited
    figures beside them (muted "was" values, a dashed line, two more heatmaps); a chip keeps the edits."""
    edits = "L0K3=-20,L1K7*-1"  # they change the tiny model's prediction after PROMPT
    page.goto(f"{server}/m/{slug}/trace?text=The+capital+of+France+is&intervene={edits}")
    page.wait_for_selector("#layers")
    assert page.locator("#summary").inner_text().count("without them") == 2  # prediction and cases
    assert page.locator("#unedited-prediction code.tok").count() == 1
    assert page.locator("#layers > tbody .was").count() >= 1
    assert page.locator("#layers > tbody .was").first.is_visible()
    page.wait_for_selector("#confidence-chart .main-svg")
    assert page.locator("#confidence-chart .scatterlayer .trace").count() == 2  # edited and unedited
    page.wait_for_selector("#trace-heatmap .updatemenu-button", state="attached")
    assert page.locator("#trace-heatmap .updatemenu-button").count() == 4
    page.locator("#token-1").click()
    page.wait_for_url("**position=1**")
    page.wait_for_selector("#token-1.selected")
    assert query(page)["intervene"] == [edits]
    assert page.locator("#unedited-prediction").count() == 1
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "live-view-edited-was.png"), full_page=True)


def test_who_pushes_the_prediction_and_a_typed_target_under_the_policy(watched, server, slug):
    """Issue 17: the attribution section renders after a trace (the prediction by default); the target box
    sends a typed token (its first token, said so), an empty box drops `target` from the URL (app.js under
    the CSP), and "who pushes it" on a top token attributes it."""
    page = watched
    run_trace(page, server, slug, PROMPT)
    section = page.locator("#attribution")
    assert section.count() == 1 and "target" not in query(page)
    prediction = page.locator("#summary code.tok").first.inner_text()
    assert section.locator("h2 code.tok").first.inner_text() == prediction
    assert page.locator("#attribution-layers > tbody > tr").count() == 3
    assert page.locator("#promoters tbody tr a").count() >= 1
    assert page.locator("#promoters tbody tr a").first.get_attribute("href").startswith(f"/m/{slug}/layers/")
    assert "veto" in page.locator("#attribution-legend").inner_text()

    page.locator("#target").fill(" Paris")
    page.locator("#run-trace").click()
    page.wait_for_function("() => new URL(location.href).searchParams.get('target') === ' Paris'")
    page.wait_for_selector("#target-note")
    assert "is 2 tokens" in page.locator("#target-note").inner_text()
    assert page.locator("#target").input_value() == " Paris"

    page.locator("#target").fill("")
    page.locator("#run-trace").click()
    page.wait_for_function("() => !new URL(location.href).searchParams.has('target')")
    page.wait_for_selector("#attribution")
    assert page.locator("#target-note").count() == 0
    assert page.locator("#attribution h2 code.tok").first.inner_text() == prediction

    link = page.locator("#prediction a.attribute").nth(1)
    token = page.locator("#prediction tbody tr").nth(1).locator("code.tok").inner_text()
    link.click()
    page.wait_for_function("() => (new URL(location.href).searchParams.get('target') || '').startsWith('#')")
    page.wait_for_selector("#attribution")
    page.wait_for_function(
        "t => document.querySelector('#attribution h2 code.tok').textContent === t", arg=token
    )
    page.screenshot(path=str(ARTIFACTS / "live-view-attribution.png"), full_page=True)


def test_a_bad_target_is_refused_next_to_the_box(page, server, slug):
    """A 400 (an id past the vocabulary): the message next to the target box, the trace kept."""
    run_trace(page, server, slug, PROMPT)
    page.locator("#target").fill("#99999")
    page.locator("#run-trace").click()
    page.wait_for_function("() => document.getElementById('target-error').textContent.includes('No token')")
    assert page.locator("#target-error").inner_text() == "Bad target: No token #99999: token ids run 0–299."
    assert page.locator("#attribution").count() == 1  # the trace on the page stays
