"""Issue 26 (2, 3, 4, 8) in Chromium: every htmx panel of the site, sent a bad request and then a good one,
shows the error next to its field or just before the panel, keeps the panel (htmx never loses its target)
and shows the good answer; long prompts and texts go as forms (POST) and are answered; the search jumps to
a key only when the form is sent; a request under way marks the panel busy.

A "bad request" is a real one: the page's own request sent with a query past the server's 8,192-byte
limit (`spoil_next`: a genuine 414 from the app), or bad input typed into the form.
"""

from __future__ import annotations

import re

import pytest
from browser_fixtures import serving

from ffmem.config import Settings
from ffmem.web.main import create_app
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

PROMPT = "The capital of France is"
TEXT = "The capital of France is Paris."
LONG = ("The capital of France is Paris. " * 313)[
    :10_000
]  # the 10,000 characters: over 8 KB as a URL
PAD = "pad=" + "a" * 9000
TOO_LONG = "Query too long: The query string is longer than 8,192 bytes"
# htmx's own complaints that a swap lost its target: none may happen
WATCH_TARGETS = """
window.targetErrors = [];
for (const name of ["htmx:targetError", "htmx:swapError"]) {
  document.addEventListener(name, (event) => window.targetErrors.push(name));
}
"""


@pytest.fixture(scope="module")
def worker(tiny, tiny_model_dir):
    """A live worker holding the tiny model (56 tokens at most); yields its URL."""
    live = Live(device="cpu", max_tokens=56)
    live.models[str(tiny_model_dir)] = tiny
    with serving(create_live_app(live)) as port:
        yield f"http://127.0.0.1:{port}"
    live.executor.shutdown(wait=False)


def explorer(explorer_db, worker, **settings):
    app = create_app(Settings(database_url=explorer_db, worker_url=worker, trace_rate_limit="0", **settings))
    with serving(app) as port:
        yield f"http://127.0.0.1:{port}"
    app.state.engine.dispose()


@pytest.fixture(scope="module")
def server(explorer_db, worker, tmp_path_factory):
    """The explorer on the tiny index, asking that worker; yields its base URL."""
    yield from explorer(explorer_db, worker, upload_dir=tmp_path_factory.mktemp("uploads"))


@pytest.fixture(scope="module")
def tight_server(explorer_db, worker):
    """The same with a 60-byte query limit: a prompt the tiny worker accepts (56 tokens) can pass it."""
    yield from explorer(explorer_db, worker, max_query_bytes=60)


@pytest.fixture
def tab(page):
    """The page, recording htmx's target errors (none may happen: checked after the test)."""
    page.add_init_script(WATCH_TARGETS)
    yield page
    assert page.evaluate("() => window.targetErrors") == []


def spoil_next(page, pattern: str) -> None:
    """The next request whose URL matches the regular expression `pattern` goes out with a query too long
    for the server: a real 414."""

    def spoil(route) -> None:
        url = route.request.url
        route.continue_(url=f"{url}{'&' if '?' in url else '?'}{PAD}")

    page.route(re.compile(pattern), spoil, times=1)


def message_in(page, selector: str, starts: str) -> str:
    """The text shown in `selector` once it starts with `starts`."""
    page.wait_for_function(
        "([s, start]) => (document.querySelector(s)?.textContent || '').trim().startsWith(start)",
        arg=[selector, starts],
    )
    return page.locator(selector).inner_text()


def key_page(server: str, slug: str) -> str:
    return f"{server}/m/{slug}/layers/1/keys/4"


# ---- 3. search ----------------------------------------------------------------------------------


def test_typing_a_key_jumps_only_on_enter(tab, server, slug):
    page = tab
    page.goto(f"{server}/m/{slug}/search")
    page.locator("#q").press_sequentially("L1 K45", delay=400)  # a pause after "L1 K4" fires a search
    jump = "() => document.querySelector('#key-jump a')?.pathname.endsWith('/layers/1/keys/45')"
    page.wait_for_function(jump)  # the run the search is pinned to stays in the link: ?run=
    assert "/search" in page.url and page.locator("#q").input_value() == "L1 K45"
    assert page.locator("#key-jump").inner_text() == "L1 K45: press Enter to open this key."
    page.locator("#q").press("Enter")
    page.wait_for_url(f"**/m/{slug}/layers/1/keys/45?run=*")
    assert page.locator("h1").inner_text().startswith("Layer 1, key 45")


def test_a_missing_key_is_said_next_to_the_box_and_the_next_search_works(tab, server, slug, db):
    page = tab
    page.goto(f"{server}/m/{slug}/search")
    page.locator("#q").fill("L99 K1")
    error = message_in(page, "#q-error", "Layer not found")
    assert error == f"Layer not found: {slug} has layers 0–2; there is no layer 99."
    assert page.locator("#results").count() == 1 and "stale" in page.locator("#results").get_attribute(
        "class"
    )
    page.locator("#q").fill("capital of")
    page.wait_for_selector("#sentence-matches a.result")
    assert page.locator("#q-error").inner_text() == "" and page.locator("#results").count() == 1
    spoil_next(page, r"/search\?")  # an error with no field: before the results
    page.locator("#q").fill("Paris")
    assert message_in(page, "#results-request-error", "Query too long").startswith(TOO_LONG)
    page.locator("#q").fill("capital of France")
    page.wait_for_selector("#results:not(.stale) #sentence-matches td.sentence mark")
    assert page.locator("#sentence-matches mark").first.inner_text() == "capital of France"
    assert page.locator("#results-request-error").inner_text() == ""


# ---- 2. the live view ---------------------------------------------------------------------------


def test_a_long_prompt_goes_as_a_form_and_the_form_stays(tab, server, slug):
    page = tab
    page.goto(f"{server}/m/{slug}/trace")
    page.locator("#prompt").fill(LONG)
    assert page.locator("#prompt").input_value() == LONG  # the box takes it: under its 16,384
    page.locator("#run-trace").click()
    notice = message_in(page, "#text-error", "Bad text: The prompt has")  # next to the box
    assert "tokens; the limit is 56 (max_prompt_tokens)" in notice  # the worker's answer: it was sent
    assert page.locator("#prompt").input_value() == LONG and page.locator("#run-trace").count() == 1
    assert page.url == f"{server}/m/{slug}/trace"  # a form: the address holds no prompt
    page.locator("#prompt").fill(PROMPT)
    page.locator("#run-trace").click()
    page.wait_for_selector("#layers")
    page.wait_for_function("text => new URL(location.href).searchParams.get('text') === text", arg=PROMPT)
    assert (
        page.locator("#share-link").get_attribute("href") == f"/m/{slug}/trace?text=The+capital+of+France+is"
    )


def test_a_prompt_too_long_for_a_url_is_traced_and_its_chips_work(tab, tight_server, slug, tiny):
    page, prompt = tab, "The capital of France is Paris. The capital of France is"  # 62 bytes as a URL
    tokens = len(tiny.tokenizer(prompt).input_ids)
    page.goto(f"{tight_server}/m/{slug}/trace")
    posts = []
    page.on("request", lambda r: posts.append(r.url) if r.method == "POST" else None)
    page.locator("#prompt").fill(prompt)
    page.locator("#run-trace").click()
    page.wait_for_selector("#layers")
    assert posts == [f"{tight_server}/m/{slug}/trace"]
    assert page.locator("#trace .chips a.chip").count() == tokens <= 56
    assert page.locator("#no-link").count() == 1 and page.locator("#share-link").count() == 0
    page.locator("#token-0").click()  # a chip's link is longer than a URL may be: a form too
    page.wait_for_selector("#token-0.selected")
    assert len(posts) == 2 and page.locator("#layers").count() == 1
    assert page.locator("#prompt").input_value() == prompt


def test_a_refused_trace_keeps_the_trace_and_the_next_one_works(tab, server, slug):
    page = tab
    page.goto(f"{server}/m/{slug}/trace?text={PROMPT}")
    page.wait_for_selector("#layers")
    spoil_next(page, r"/trace\?")
    page.locator("#token-1").click()
    assert message_in(page, "#trace-request-error", "Query too long").startswith(TOO_LONG)
    assert page.locator("#trace #layers").count() == 1 and page.locator("#prompt").count() == 1
    page.locator("#token-2").click()
    page.wait_for_selector("#token-2.selected")
    assert page.locator("#trace-request-error").inner_text() == ""


# ---- 4. try your own text -----------------------------------------------------------------------


def test_a_long_text_goes_as_a_form_and_the_answer_area_stays(tab, server, slug):
    page = tab
    page.goto(key_page(server, slug))
    page.locator("#try-text-input").fill(LONG)
    page.locator("#try-text-run").click()
    notice = message_in(page, "#text-error", "Bad text: The prompt has")  # next to the box
    assert "tokens; the limit is 56 (max_prompt_tokens)" in notice
    assert page.locator("#try_text").count() == 1 and page.locator("#try-text-input").input_value() == LONG
    page.locator("#try-text-input").fill(TEXT)
    page.locator("#try-text-run").click()
    page.wait_for_selector("#try-text-shaded")
    spoil_next(page, r"/keys/4\?")
    page.locator("#try-text-input").fill(PROMPT)
    page.locator("#try-text-run").click()
    assert message_in(page, "#try_text-request-error", "Query too long").startswith(TOO_LONG)
    assert page.locator("#try_text #try-text-shaded").count() == 1  # the answer before, dimmed
    assert "stale" in page.locator("#try_text").get_attribute("class").split()
    page.locator("#try-text-run").click()
    page.wait_for_function("text => new URL(location.href).searchParams.get('text') === text", arg=PROMPT)
    page.wait_for_function("() => !document.querySelector('#try_text').classList.contains('stale')")
    assert page.locator("#try-text-shaded").count() == 1
    assert page.locator("#try_text-request-error").inner_text() == ""


# ---- the key page's other panels ----------------------------------------------------------------


def test_test_this_memory_after_a_refusal(tab, server, slug):
    page = tab
    page.goto(key_page(server, slug))
    spoil_next(page, r"/ablation")
    page.locator("#test-memory").click()
    assert message_in(page, "#ablation-request-error", "Query too long").startswith(TOO_LONG)
    assert page.locator("#ablation").count() == 1
    page.locator("#test-memory").click()
    page.wait_for_selector("#ablation table.ablation")
    assert page.locator("#ablation-request-error").inner_text() == ""


def test_the_label_form_after_refusals(tab, server, slug):
    page = tab
    page.goto(key_page(server, slug))
    page.locator("#label button[type=submit]").click()  # nothing typed: refused next to the field
    assert message_in(page, "#pattern-error", "Empty label") == (
        "Empty label: Give a pattern description, a tag (shallow or semantic), or both."
    )
    spoil_next(page, r"/labels$")
    page.locator("#label input[name=pattern]").fill("ends in a capital")
    page.locator("#label button[type=submit]").click()
    assert message_in(page, "#label-request-error", "Query too long").startswith(TOO_LONG)
    page.locator("#label button[type=submit]").click()
    page.wait_for_function(
        "() => document.querySelector('#current-label')?.textContent.includes('ends in a capital')"
    )
    assert page.locator("#label").count() == 1 and page.locator("#label-request-error").inner_text() == ""


@pytest.mark.parametrize("panel", ["samples", "related"])
def test_a_section_loaded_when_seen_survives_a_refusal(tab, server, slug, panel):
    page = tab
    spoil_next(page, f"/keys/4/{panel}")
    page.goto(key_page(server, slug))
    page.locator(f"#{panel}").scroll_into_view_if_needed()
    assert message_in(page, f"#{panel}-request-error", "Query too long").startswith(TOO_LONG)
    assert page.locator(f"#{panel}").count() == 1  # the placeholder and its link stay
    again = "p => htmx.ajax('GET', document.getElementById(p).getAttribute('hx-get'), "
    again += "{target: '#' + p, swap: 'outerHTML'})"
    page.evaluate(again, panel)  # the same request again, as htmx sends it
    page.wait_for_selector(f"#{panel}:not([hx-get])")  # the loaded section
    assert page.locator(f"#{panel}").count() == 1


# ---- the layer page and the corpora page ---------------------------------------------------------


def test_the_layer_table_after_a_refusal(tab, server, slug):
    page = tab
    page.goto(f"{server}/m/{slug}/layers/1")
    spoil_next(page, r"/layers/1\?")
    page.locator("a.sort", has_text="max m").click()
    assert message_in(page, "#keys-request-error", "Query too long").startswith(TOO_LONG)
    assert page.locator("#keys table.keys tbody tr").count() == 48
    page.locator("a.sort", has_text="max m").click()
    page.wait_for_url("**sort=max_coefficient**")
    assert page.locator("#keys-request-error").inner_text() == ""


def test_an_upload_after_refusals(tab, server, tmp_path):
    page = tab
    binary, good = tmp_path / "corpus.bin.txt", tmp_path / "corpus.txt"
    binary.write_bytes(b"\x00\x01\x02" * 100)
    good.write_text("The capital of France is Paris.\nWater boils at one hundred degrees.\n")
    page.goto(f"{server}/corpora")
    page.locator("#file").set_input_files(str(binary))
    page.locator("#upload button[type=submit]").click()
    assert message_in(page, "#file-error", "Unusable corpus").startswith(
        "Unusable corpus: The corpus corpus.bin.txt is not UTF-8 text"
    )
    spoil_next(page, r"/corpora$")
    page.locator("#file").set_input_files(str(good))
    page.locator("#upload button[type=submit]").click()
    assert message_in(page, "#corpora-request-error", "Query too long").startswith(TOO_LONG)
    page.locator("#upload button[type=submit]").click()
    page.wait_for_selector("#upload-result")
    assert "corpus.txt" in page.locator("#upload-result").inner_text()


# ---- 8. busy ------------------------------------------------------------------------------------


def test_a_search_under_way_is_shown_busy(watched, server, slug):
    page = watched
    page.goto(f"{server}/m/{slug}/search")
    held = []
    page.route(re.compile(r"/search\?"), lambda route: held.append(route))
    page.locator("#q").fill("capital of")
    page.wait_for_function("() => document.getElementById('results').getAttribute('aria-busy') === 'true'")
    form = page.locator("form.search")
    assert form.get_attribute("aria-busy") == "true"
    assert page.locator("#results").evaluate("e => getComputedStyle(e).opacity") == "0.6"
    assert form.evaluate("e => getComputedStyle(e).cursor") == "progress"
    spinner = "e => getComputedStyle(e, '::after').animationName"
    assert page.locator("form.search button[type=submit]").evaluate(spinner) == "spin"
    held[0].continue_()
    page.wait_for_selector("#sentence-matches a.result")
    assert (
        page.locator("#results").get_attribute("aria-busy") is None
        and form.get_attribute("aria-busy") is None
    )
    assert page.locator("#results").evaluate("e => getComputedStyle(e).opacity") == "1"


# ---- issue 39 (1): busy ends on every answer ----------------------------------------------------

BUSY = "() => [...document.querySelectorAll('[aria-busy]')].map(e => e.id || e.tagName)"


def test_busy_ends_after_an_error_or_no_answer_and_errors_are_logged_once(tab, server, slug):
    """An error answer goes to its message slot; the panel and the form that asked stop being busy all
    the same (only stale results stay dimmed), and htmx does not log what it showed as a console error."""
    page, console = tab, []
    page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
    page.goto(f"{server}/m/{slug}/trace")
    page.locator("#prompt").fill(LONG)
    page.locator("#run-trace").click()
    message_in(page, "#text-error", "Bad text: The prompt has")
    assert page.evaluate(BUSY) == []
    assert page.locator("#trace").evaluate("e => getComputedStyle(e).opacity") == "1"
    page.route(re.compile(r"/trace\?"), lambda route: route.abort(), times=1)  # the network fails
    page.locator("#prompt").fill(PROMPT)
    page.locator("#run-trace").click()
    assert message_in(page, "#trace-request-error", "No answer") == (
        "No answer: the server could not be reached. Try again."
    )
    assert page.evaluate(BUSY) == [] and page.locator("#run-trace").is_enabled()
    page.goto(f"{server}/m/{slug}/search")
    page.locator("#q").fill("L99 K1")
    message_in(page, "#q-error", "Layer not found")
    assert page.evaluate(BUSY) == []
    assert page.locator("#results").evaluate("e => getComputedStyle(e).opacity") == "0.4"  # stale
    page.goto(key_page(server, slug))
    page.locator("#try-text-input").fill(LONG)
    page.locator("#try-text-run").click()
    message_in(page, "#text-error", "Bad text: The prompt has")
    assert page.evaluate(BUSY) == []
    # Chromium logs each refused request once, htmx no more; a failed network htmx logs as it always does
    network = ["htmx:afterRequest, [object HTMLDivElement]", "htmx:sendError, [object HTMLDivElement]"]
    network.append("Failed to load resource: net::ERR_FAILED")
    refused = [
        f"Failed to load resource: the server responded with a status of {s}"
        for s in ("400 (Bad Request)", "404 (Not Found)", "400 (Bad Request)")
    ]
    assert console == [refused[0], *network, *refused[1:]]
