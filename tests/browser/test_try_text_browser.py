"""Issue 15, "try your own text" on a key page in a real browser (Playwright driving Debian's Chromium)
under the app's CSP: type a text, press the button, htmx swaps only the section, the URL keeps the text,
every token is shaded by its coefficient (the styles apply: no CSP violation), a bad text is refused next
to the box, and with no live worker the section says so while the key page stays whole."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest
from browser_fixtures import ARTIFACTS, serving

from ffmem.config import Settings
from ffmem.web.main import create_app
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

TEXT = "The capital of France is Paris."
HOSTILE = '<script>alert(1)</script> "><img src=x onerror=alert(1)>'
LAYER, KEY = 1, 4
# Each shaded token: the text it shows (its first child), m, the background and outline Chromium drew.
TOKENS = """() => Array.from(document.querySelectorAll("#try-text-shaded > .stok")).map(e => ({
  text: e.firstChild ? e.firstChild.nodeType === 3 ? e.firstChild.textContent : "" : "",
  m: e.dataset.m === undefined ? null : Number(e.dataset.m),
  title: e.title, classes: e.className,
  background: getComputedStyle(e).backgroundColor, outline: getComputedStyle(e).outlineStyle,
  hidden: Array.from(e.querySelectorAll(".sr-only")).map(s => s.getBoundingClientRect().width),
}))"""


@pytest.fixture(scope="module")
def server(explorer_db, tiny, tiny_model_dir):
    """The explorer on the tiny index with a live worker holding the tiny model; yields its base URL."""
    live = Live(device="cpu", max_tokens=56)
    live.models[str(tiny_model_dir)] = tiny
    with serving(create_live_app(live)) as worker_port:
        app = create_app(Settings(database_url=explorer_db, worker_url=f"http://127.0.0.1:{worker_port}"))
        with serving(app) as port:
            yield f"http://127.0.0.1:{port}"
        app.state.engine.dispose()
    live.executor.shutdown(wait=False)


@pytest.fixture(scope="module")
def lonely_server(explorer_db):
    """The explorer with no live worker answering; yields its base URL."""
    app = create_app(Settings(database_url=explorer_db, worker_url="http://127.0.0.1:9", worker_timeout=5))
    with serving(app) as port:
        yield f"http://127.0.0.1:{port}"
    app.state.engine.dispose()


def key_page(base: str, slug: str) -> str:
    return f"{base}/m/{slug}/layers/{LAYER}/keys/{KEY}"


def try_text(page, text: str) -> None:
    """Type `text` into the box and press the button (htmx swaps the answer into #try_text)."""
    page.locator("#try-text-input").fill(text)
    page.locator("#try-text-run").click()


def test_type_a_text_and_see_every_token_shaded(watched, server, slug, tiny):
    page = watched
    page.goto(key_page(server, slug))
    assert page.locator("#try-text-shaded").count() == 0
    page.evaluate("() => { window.__marker = 1; }")
    try_text(page, TEXT)
    page.wait_for_function("text => new URL(location.href).searchParams.get('text') === text", arg=TEXT)
    page.wait_for_selector("#try-text-shaded")
    assert page.evaluate("() => window.__marker") == 1  # htmx swapped the section: no page load
    assert parse_qs(urlsplit(page.url).query)["text"] == [TEXT]
    tokens = page.evaluate(TOKENS)
    assert len(tokens) == len(tiny.tokenizer(TEXT).input_ids)
    assert "".join(t["text"] for t in tokens) == TEXT  # the shaded tokens read as the text typed
    body = page.request.get(f"{key_page(server, slug)}.json?text={TEXT}").json()["try_text"]
    assert [t["m"] for t in tokens] == pytest.approx([t["coefficient"] for t in body["shaded"]["tokens"]])
    scale = body["shaded"]["scale"]
    for token in tokens:
        sign = "m-pos" if token["m"] > 0 else "m-neg"
        assert token["title"].startswith("m = +" if token["m"] >= 0 else "m = -")
        assert all(width <= 1 for width in token["hidden"])  # the value for screen readers, not on screen
        if abs(token["m"]) / scale > 0.05:  # the style attribute and the stylesheet applied under the CSP
            assert sign in token["classes"].split()
            assert token["background"] not in ("rgba(0, 0, 0, 0)", "transparent")
            blue = token["background"].startswith("rgba(43, 108, 176")
            assert blue == (token["m"] > 0), token
    peak = body["max"]["position"]
    assert tokens[peak]["outline"] == "solid" and "peak" in tokens[peak]["classes"].split()
    assert sum(t["outline"] == "solid" for t in tokens) == 1
    summary = page.locator("#try-text-summary").inner_text()
    assert f"max m {body['max']['coefficient']:.4g} at position {peak}" in summary
    assert page.locator("#triggers").count() == 1  # the rest of the key page is still there
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.locator("#try_text").screenshot(path=str(ARTIFACTS / "try-text.png"))
    page.reload()  # the shared URL renders the same answer as a full page
    page.wait_for_selector("#try-text-shaded")
    assert [t["m"] for t in page.evaluate(TOKENS)] == [t["m"] for t in tokens]
    assert page.locator("#try-text-input").input_value() == TEXT


def test_a_hostile_text_stays_text(watched, server, slug, dialogs):
    page = watched
    page.goto(key_page(server, slug))
    try_text(page, HOSTILE)
    page.wait_for_selector("#try-text-shaded")
    assert "".join(t["text"] for t in page.evaluate(TOKENS)) == HOSTILE
    assert page.locator("#try_text img").count() == 0 and page.locator("#try_text script").count() == 0
    page.reload()
    page.wait_for_selector("#try-text-shaded")
    assert "".join(t["text"] for t in page.evaluate(TOKENS)) == HOSTILE
    assert dialogs == []


def test_a_bad_text_is_refused_next_to_the_box(page, server, slug):  # the 400 is a console error
    page.goto(key_page(server, slug))
    try_text(page, TEXT)
    page.wait_for_selector("#try-text-shaded")
    try_text(page, "   ")  # not empty to the browser (required), empty to the server
    error = page.locator("#text-error")
    error.wait_for()
    page.wait_for_function("() => document.getElementById('text-error').textContent.length > 0")
    assert error.inner_text() == "Empty text: The text is empty: type some text."
    assert page.locator("#try-text-shaded").count() == 1  # the answer before stays, dimmed
    assert "stale" in page.locator("#try_text").get_attribute("class").split()


def test_no_worker_says_so_in_the_section(page, lonely_server, slug):  # the 503 is a console error
    response = page.goto(key_page(lonely_server, slug))
    assert response.status == 200
    try_text(page, TEXT)
    notice = page.locator("#try-text-notice")
    notice.wait_for()
    assert "no live worker answers" in notice.inner_text().lower()
    assert page.locator("#triggers").count() == 1 and page.locator("#try-text-shaded").count() == 0
