"""Issue 42 (5) in Chromium: the key page's first screen at 1,280 × 800 holds the explanation, the top shaded
triggers of both signs and the value's tokens side by side (the raw-readout table inside its column), with a
table of contents whose every entry leads to a section; at 390 px the two columns stack and nothing scrolls
sideways. Screenshots of both go to the artifacts folder (FFMEM_ARTIFACTS)."""

from __future__ import annotations

import pytest
from browser_fixtures import ARTIFACTS, serving

from ffmem.config import Settings
from ffmem.web.main import create_app

FIRST_SCREEN = [
    "#explanation h2",
    "#reads ol.top-triggers.positive li",
    "#reads ol.top-triggers.negative li",
    "#writes #value-raw-compact",
    "#token-change-form",
    "#toc",
]


@pytest.fixture(scope="module")
def server(explorer_db):
    app = create_app(Settings(database_url=explorer_db))
    with serving(app) as port:
        yield f"http://127.0.0.1:{port}"
    app.state.engine.dispose()


def box(page, selector: str) -> dict:
    return page.locator(selector).first.bounding_box()


def test_the_first_screen_at_1280_holds_what_it_reads_and_writes_side_by_side(page, server, slug):
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(f"{server}/m/{slug}/layers/1/keys/4")
    for selector in FIRST_SCREEN:
        found = box(page, selector)
        assert found is not None and found["y"] + found["height"] <= 800, (selector, found)
    reads, writes = box(page, "#reads"), box(page, "#writes")
    assert writes["x"] >= reads["x"] + reads["width"] and abs(writes["y"] - reads["y"]) < 1  # side by side
    table = page.locator("#value-raw-compact")
    assert table.evaluate(
        "t => t.getBoundingClientRect().right <= t.closest('section').getBoundingClientRect().right + 0.5"
    )
    assert table.evaluate("t => t.scrollWidth <= t.clientWidth")  # its last column is not cut
    assert page.locator("#reads .shaded").count() >= 2  # shaded sentences, not bare prefixes
    assert page.evaluate("() => document.documentElement.scrollWidth <= innerWidth")
    targets = page.locator("#toc a").evaluate_all("links => links.map(a => a.getAttribute('href'))")
    assert targets == [
        "#triggers-section",
        "#does",
        "#value",
        "#statistics",
        "#try-box",
        "#label",
        "#related",
    ]
    for target in targets:
        assert page.locator(target).count() == 1, target
    page.screenshot(path=str(ARTIFACTS / "key-first-screen-1280.png"))


def test_at_390_px_the_columns_stack(page, server, slug):
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{server}/m/{slug}/layers/1/keys/4")
    reads, writes = box(page, "#reads"), box(page, "#writes")
    assert writes["y"] >= reads["y"] + reads["height"] - 0.5
    assert page.evaluate("() => document.documentElement.scrollWidth <= innerWidth")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "key-first-screen-390.png"), full_page=False)
