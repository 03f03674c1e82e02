"""Issue 39 (4, 5) in Chromium at 1,280 × 800: the layer table fits without a sideways scroll (its columns
balanced, long cells cut with their whole text as a tooltip) and the key page's "try your own text" box is a
usable size.

The tiny index's tokens are short, so the table's cells are given the long texts a real model has (a long
prefix, long value tokens, a long label) before it is measured: what is tested is how the page lays them out.
"""

from __future__ import annotations

import pytest
from browser_fixtures import serving

from ffmem.config import Settings
from ffmem.web.main import create_app

LONG_TOKEN = "␣responsibilities"
WIDEN = """() => {
  const row = document.querySelector('table.keys tbody tr');
  row.querySelector('td.tokens').innerHTML = Array(5).fill('<code class="tok">LONG</code>').join(' ');
  row.querySelector('td.label').textContent = 'a long description of what this memory is about, '.repeat(3);
}""".replace("LONG", LONG_TOKEN)


@pytest.fixture(scope="module")
def server(explorer_db):
    app = create_app(Settings(database_url=explorer_db))
    with serving(app) as port:
        yield f"http://127.0.0.1:{port}"
    app.state.engine.dispose()


def width(page, selector: str) -> float:
    return page.locator(selector).first.evaluate("e => e.getBoundingClientRect().width")


def test_the_layer_table_fits_a_laptop_and_the_try_box_is_usable(page, server, slug):
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(f"{server}/m/{slug}/layers/1")
    page.evaluate(WIDEN)
    box = page.locator("#keys .scroll")
    assert box.evaluate("e => e.scrollWidth <= e.clientWidth"), box.evaluate(
        "e => [e.scrollWidth, e.clientWidth]"
    )
    assert page.evaluate("() => document.documentElement.scrollWidth <= innerWidth")
    prefix, tokens = width(page, "table.keys td.prefix-cell"), width(page, "table.keys td.tokens")
    assert prefix >= tokens, (prefix, tokens)  # the trigger's sentence gets the room, not the value's tokens
    cut = page.locator("table.keys tbody tr td.tokens").first
    assert cut.evaluate("e => getComputedStyle(e).textOverflow") == "ellipsis"
    first = page.locator("table.keys tbody tr").nth(1).locator("td.tokens")
    shown = first.locator("code.tok").all_inner_texts()
    assert first.get_attribute("title") == " ".join(shown)  # the whole list as a tooltip
    page.goto(f"{server}/m/{slug}/layers/1/keys/4")
    text = page.locator("#try-text-input").bounding_box()
    assert text["width"] >= 600 and text["height"] >= 90, text
    # Issue 39 (4): the log axes of counts label their decades only (not "100, 5, 2, 10").
    for chart in ("#histogram-chart", "#value-histogram-raw"):
        page.wait_for_selector(f"{chart} .ytick text", state="attached")
        labels = page.locator(f"{chart} .ytick text").all_text_contents()
        assert labels and all(label in ("0.1", "1", "10", "100", "1000", "1k") for label in labels), labels
