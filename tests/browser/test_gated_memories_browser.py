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


# Every label plotly drew in a chart (the axes' ticks, the points' texts, annotations), as boxes; a label
# hidden (display: none, as static/charts.js hides one that would cover another) or empty is not drawn.
CHART_LABELS = """(id) => {
  const chart = document.getElementById(id);
  const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const drawn = [...chart.querySelectorAll(".xtick text, .ytick text, .textpoint text, .annotation-text")]
    .filter((e) => getComputedStyle(e).display !== "none" && e.getBoundingClientRect().width > 0);
  return {svg: box(chart.querySelector(".main-svg")), labels: drawn.map((e) => [e.textContent, box(e)])};
}"""


def labels_apart_and_inside(page, chart: str) -> list[str]:
    """The chart's labels, after checking that each lies inside its SVG and none covers another (±1 px)."""
    page.wait_for_selector(f"#{chart} .main-svg .xtick text", state="attached", timeout=15_000)
    drawn = page.evaluate(CHART_LABELS, chart)
    (left, top, right, bottom), labels = drawn["svg"], drawn["labels"]
    for text, (x0, y0, x1, y1) in labels:
        assert left - 1 <= x0 and x1 <= right + 1 and top - 1 <= y0 and y1 <= bottom + 1, (
            chart,
            text,
            drawn["svg"],
        )
    for i, (text, (x0, y0, x1, y1)) in enumerate(labels):
        for other, (a0, b0, a1, b1) in labels[i + 1 :]:
            assert x1 <= a0 + 1 or a1 <= x0 + 1 or y1 <= b0 + 1 or b1 <= y0 + 1, (chart, text, other)
    return [text for text, _ in labels]


@pytest.mark.parametrize("width", [1280, 390])
def test_chart_labels_lie_inside_and_apart(watched, server, slug, width):
    """Issue 39 (1–4): the key page's charts (the coefficient's octave bins, the value's histograms, the
    weight graph) and the memory circuit (hops 1 and 2) on a laptop and on a phone: every label inside its
    chart, none on another."""
    page = watched
    page.set_viewport_size({"width": width, "height": 844 if width == 390 else 800})
    page.goto(f"{server}/m/{slug}/layers/{LAYER}/keys/{KEY}")
    octaves = labels_apart_and_inside(page, "histogram-chart")
    powers = [label.replace("\u200b", "") for label in octaves if "2\u200b" in label]  # 2<sup>5</sup>
    assert {"−1", "0", "1"} <= set(octaves) and len(powers) >= 4, octaves  # the edges still named
    for readout in ("raw", "norm"):
        labels_apart_and_inside(page, f"value-histogram-{readout}")
        assert page.locator(f"#value-histogram-{readout} .textpoint text").count() >= 1  # tokens named
    page.locator("#related").scroll_into_view_if_needed()  # loaded when seen
    labels_apart_and_inside(page, "weight-graph-chart")
    for hops in (1, 2):
        page.goto(f"{server}/m/{slug}/trace/circuit?text={PROMPT}&hops={hops}")
        names = labels_apart_and_inside(page, "circuit-chart")
        ticks = page.locator("#circuit-chart .xtick text").all_text_contents()
        assert ticks and all(tick.startswith("L") for tick in ticks), ticks  # the layers present only
        assert sum("K" in name for name in names) >= 3, names  # memories named


SEEN_BUSY = """document.addEventListener("DOMContentLoaded", () => {
  const busy = document.querySelector("#ablation #ablation-computing[aria-busy='true']");
  window.sawBusy = busy !== null && busy.checkVisibility();
});"""


def test_the_ablation_page_shows_it_is_computing_until_its_result_replaces_it(watched, server, slug):
    """Issue 39 (5): the page shows at once, a visible busy mark where the result will go; htmx loads the
    result into that place, and no busy mark is left."""
    page = watched
    page.add_init_script(SEEN_BUSY)
    page.goto(f"{server}/m/{slug}/layers/{LAYER}/keys/{KEY}/ablation?triggers=3")
    assert page.evaluate("window.sawBusy") is True  # shown before the result came
    page.wait_for_selector("#ablation table.ablation")
    assert page.locator("#ablation tbody tr").count() == 3
    assert (
        page.locator("#ablation-computing").count() == 0 and page.locator("[aria-busy='true']").count() == 0
    )
