"""Issue 30 in Chromium, under the app's CSP: a gated key's 2×2 quadrant panel and its quadrant pages, the
statistics panel's charts (the try-text marker redrawn when a text is tried), and a prompt's memory circuit
drawn as a graph whose nodes open key pages — at desktop and phone widths, with no CSP violation."""

from __future__ import annotations

import pytest
from browser_fixtures import ARTIFACTS, serving

from ffmem.config import Settings
from ffmem.web.main import create_app
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

LAYER, KEY = 1, 4
TEXT = "The capital of France is Paris."
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(explorer_db, tiny, tiny_model_dir):
    """The explorer on the tiny index with a live worker holding the tiny model; yields its base URL."""
    live = Live(device="cpu", max_tokens=56)
    live.models[str(tiny_model_dir)] = tiny
    with serving(create_live_app(live)) as worker_port:
        settings = Settings(
            database_url=explorer_db, worker_url=f"http://127.0.0.1:{worker_port}", trace_rate_limit="0"
        )
        app = create_app(settings)
        with serving(app) as port:
            yield f"http://127.0.0.1:{port}"
        app.state.engine.dispose()
    live.executor.shutdown(wait=False)


def drawn(page, selector: str) -> None:
    """Plotly drew the chart in `selector` (its SVG is there)."""
    page.wait_for_selector(f"{selector} .main-svg", timeout=15_000)


def test_the_quadrant_panel_links_each_quadrant_to_its_examples(watched, server, slug):
    page = watched
    page.goto(f"{server}/m/{slug}/layers/{LAYER}/keys/{KEY}")
    body = page.request.get(f"{server}/m/{slug}/layers/{LAYER}/keys/{KEY}.json").json()["quadrants"]
    cells = page.locator("#quadrants td.quadrant")
    assert cells.count() == 4
    shares = [f"{100 * q['share']:.1f}%" for q in body["quadrants"]]
    assert [cells.nth(i).locator(".share").inner_text() for i in range(4)] == shares
    dominant = page.locator("#quadrants td.dominant")
    assert dominant.count() == 1 and dominant.evaluate("e => getComputedStyle(e).outlineStyle") == "solid"
    page.locator("#quadrants").screenshot(path=str(ARTIFACTS / "quadrants.png"))
    chosen = next(q for q in body["quadrants"] if q["examples"])
    page.locator(f'#quadrants a[href="{chosen["url"]}"]').click()
    page.wait_for_url(f"**/quadrants/{chosen['quadrant']}?run=*")
    rows = page.locator("table.quadrant-examples tbody tr")
    assert rows.count() == chosen["examples"]
    assert rows.first.locator("mark").count() == 1  # the token where |m| is largest, marked


def test_the_statistics_panel_draws_and_marks_a_tried_text(watched, server, slug):
    page = watched
    page.goto(f"{server}/m/{slug}/layers/{LAYER}/keys/{KEY}")
    for chart in ("#histogram-chart", "#value-histogram-raw", "#value-histogram-norm"):
        drawn(page, chart)
    assert page.locator("#histogram-chart .shapelayer path").count() == 0  # no text yet: no marker
    page.locator("#try-text-input").fill(TEXT)
    page.locator("#try-text-run").click()
    page.wait_for_selector("#try-text-shaded")
    page.wait_for_selector("#histogram-chart .shapelayer path", state="attached", timeout=15_000)  # marked
    assert "your text: max m" in page.locator("#histogram-chart").inner_text()
    page.locator("#statistics").screenshot(path=str(ARTIFACTS / "statistics.png"))


def test_a_circuit_is_a_graph_whose_nodes_open_key_pages(watched, server, slug):
    page = watched
    page.goto(f"{server}/m/{slug}/trace/circuit?text={PROMPT}")
    page.wait_for_selector("#circuit-summary")
    drawn(page, "#circuit")
    links = page.locator("#circuit-nodes-table a[href*='/keys/']")
    assert links.count() >= 1
    href = links.first.get_attribute("href")
    page.locator("#circuit").screenshot(path=str(ARTIFACTS / "circuit.png"))
    links.first.click()
    page.wait_for_url(f"**{href}")
    assert page.locator("h1").inner_text().startswith("Layer")


def test_the_panels_fit_a_phone(watched, server, slug):
    page = watched
    page.set_viewport_size({"width": 390, "height": 844})
    for path in (f"/m/{slug}/layers/{LAYER}/keys/{KEY}", f"/m/{slug}/layers/{LAYER}/keys/{KEY}/quadrants/pp"):
        page.goto(f"{server}{path}")
        overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, (path, overflow)
