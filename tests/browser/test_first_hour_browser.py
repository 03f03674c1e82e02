"""A first hour in a real browser (Playwright driving Debian's Chromium), on a tiny SQLite index with its
analyses and a live worker: the home page's next steps, "working" indicators during a deliberately slow
trace and memory test, errors shown next to the field that caused them with the page kept, state kept
(the layer page's sort, the live view's heatmap mode), labels saved and deleted, a corpus uploaded, and
every kind of page at a phone's width (390 px) without the page scrolling sideways.

Skipped when Chromium is not installed, except on CI (env CI set), where that is a failure.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from urllib.parse import parse_qs, urlsplit

import pytest
from browser_fixtures import screenshot, serving
from sqlalchemy import delete, select

from bench.tiny_tokenizer import TRAINING_TEXT
from ffmem.config import Settings
from ffmem.store import jobs
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.models import Explanation, Job, Label, LanguageModel
from ffmem.store.specs import AnalysisSpec, RunSpec
from ffmem.web.main import create_app
from ffmem.web.worker_client import LiveWorker
from ffmem.worker.analysis_jobs import AnalysisOptions, analyze
from ffmem.worker.index import IndexOptions
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live
from ffmem.worker.loop import build_index

PROMPT = "The capital of France is"
HELD_OUT = ["The river flows into the sea.", "Rome was not built in a day.", "Light outruns sound."]
SLOW = 1.5  # seconds the slow live worker waits before each answer


class SlowLiveWorker(LiveWorker):
    """The real live worker, answering `SLOW` seconds late: long enough to see what a page does meanwhile."""

    def trace(self, payload: dict):
        time.sleep(SLOW)
        return super().trace(payload)

    def ablation(self, payload: dict):
        time.sleep(SLOW)
        return super().ablation(payload)


@pytest.fixture(scope="module")
def index(tiny, tiny_model_dir, tmp_path_factory):
    """A SQLite index of the tiny model with its analyses; its URL, slug, job id and folders."""
    folder = tmp_path_factory.mktemp("first-hour")
    url = f"sqlite:///{folder / 'ffmem.db'}"
    upgrade(url)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(TRAINING_TEXT + HELD_OUT) + "\n")
    settings = Settings(
        model=str(tiny_model_dir), corpus=str(corpus), sentences=len(TRAINING_TEXT), top_k=4, device="cpu",
        dtype="float32", batch_tokens=128, shard_sentences=8, value_tokens=5, cache_dir=folder / "cache",
    )  # fmt: skip
    options = IndexOptions.from_settings(settings, progress=False)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    summary = build_index(options, sessions, loaded=tiny)
    spec = AnalysisSpec(examples=3, keys=2, triggers=2, seed=0)
    analyze(sessions, summary.run_id, tiny, AnalysisOptions(spec, progress=False))
    with sessions() as session:
        slug = session.scalars(select(LanguageModel.slug)).one()
        job = session.scalars(select(Job.id).order_by(Job.id)).first()
    engine.dispose()
    return {"url": url, "slug": slug, "job": job, "uploads": folder / "uploads"}


@pytest.fixture(scope="module")
def worker(tiny, tiny_model_dir):
    """The live worker holding the tiny model; yields its URL."""
    live = Live(device="cpu")
    live.models[str(tiny_model_dir)] = tiny
    with serving(create_live_app(live)) as port:
        yield f"http://127.0.0.1:{port}"
    live.executor.shutdown(wait=False)


def explorer(index, worker, **settings):
    settings = Settings(database_url=index["url"], worker_url=worker, upload_dir=index["uploads"], **settings)
    return settings


@pytest.fixture(scope="module")
def server(index, worker):
    """The explorer over the index, asking the live worker; yields its base URL."""
    app = create_app(explorer(index, worker))
    with serving(app) as port:
        yield f"http://127.0.0.1:{port}"
    app.state.engine.dispose()


@pytest.fixture(scope="module")
def slow_server(index, worker):
    """The explorer asking the live worker through a client that answers SLOW seconds late."""
    settings = explorer(index, worker)
    app = create_app(settings, live=SlowLiveWorker(worker, settings.worker_timeout))
    with serving(app) as port:
        yield f"http://127.0.0.1:{port}"
    app.state.engine.dispose()


@pytest.fixture(params=[390, 1024], ids=["phone", "small laptop"])
def phone(browser, request, dialogs):
    """A page 390 px wide (a phone) or 1024 px (a small laptop), failing its test on any page error."""
    context = browser.new_context(viewport={"width": request.param, "height": 844}, device_scale_factor=1)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    screenshot(page, request)
    context.close()
    assert errors == [], errors


def query(page) -> dict[str, list[str]]:
    return parse_qs(urlsplit(page.url).query, keep_blank_values=True)


def run_trace(page, base: str, slug: str, text: str = PROMPT) -> None:
    page.goto(f"{base}/m/{slug}/trace")
    page.locator("#prompt").fill(text)
    page.locator("#run-trace").click()
    page.wait_for_selector("#layers")
    page.wait_for_selector("#trace-heatmap .main-svg")


def no_sideways_scroll(page) -> tuple[int, int]:
    return page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")


# ---- the home page tells the next step ----------------------------------------------------------


def test_home_page_offers_the_next_steps(page, server, index):
    slug = index["slug"]
    page.goto(server)
    steps = page.locator("#next-steps")
    assert steps.locator("a#start-live").get_attribute("href").startswith(f"/m/{slug}/trace?text=")
    assert steps.locator("a#start-search").get_attribute("href") == f"/m/{slug}/search"
    assert steps.locator("a#start-analysis").get_attribute("href") == f"/m/{slug}/analysis"
    assert steps.locator("a#start-layers").get_attribute("href") == f"/m/{slug}"
    box = page.locator("header form.searchbox input[name=q]")  # the header's search box, as on every page
    assert box.get_attribute("maxlength") == "200"
    box.fill("Paris")
    box.press("Enter")
    page.wait_for_url(f"**/m/{slug}/search?q=Paris")
    page.goto(server)
    page.locator("a#start-live").click()
    page.wait_for_selector("#layers")  # the example prompt, traced
    assert page.locator("#prompt").input_value() == PROMPT
    page.goto(server)
    page.locator("a#start-analysis").click()
    page.wait_for_selector("#fig4 .main-svg")


# ---- "working" while the live worker computes ---------------------------------------------------


def test_a_slow_trace_shows_that_it_is_working(page, slow_server, index):
    slug = index["slug"]
    page.goto(f"{slow_server}/m/{slug}/trace")
    indicator = page.locator("#trace-working")
    assert not indicator.is_visible()
    page.locator("#prompt").fill(PROMPT)
    page.locator("#run-trace").click()
    indicator.wait_for(state="visible", timeout=1000)  # at once, while the worker takes SLOW seconds
    assert "Tracing" in indicator.inner_text()
    assert "htmx-request" in page.locator("#trace").get_attribute("class")  # the old trace dims
    assert page.locator("#run-trace").is_disabled()
    page.wait_for_selector("#layers")
    indicator.wait_for(state="hidden")
    assert "htmx-request" not in (page.locator("#trace").get_attribute("class") or "")
    page.locator("#token-1").click()  # picking a position asks the worker again: the same indicator
    indicator.wait_for(state="visible", timeout=1000)
    page.wait_for_selector("#token-1.selected")
    indicator.wait_for(state="hidden")


def test_a_slow_memory_test_shows_that_it_is_working(page, slow_server, index):
    page.goto(f"{slow_server}/m/{index['slug']}/layers/2/keys/3")
    indicator = page.locator("#ablation-working")
    assert not indicator.is_visible()
    page.locator("#test-memory").click()
    indicator.wait_for(state="visible", timeout=1000)
    assert page.locator("#test-memory").is_disabled()
    page.wait_for_selector("#ablation table.ablation")
    indicator.wait_for(state="hidden")
    assert page.locator("#test-memory").is_enabled()


# ---- errors next to their field, the page kept --------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"), [("garbage", "Bad intervention"), ("L99K1", "layer 99"), ("L1K999", "key 999")]
)
def test_a_bad_edit_is_shown_next_to_the_field_and_the_trace_stays(page, server, index, edit, message):
    run_trace(page, server, index["slug"])
    before = page.url
    page.locator("#intervene").fill(edit)
    page.locator("#run-trace").click()
    error = page.locator("#intervene-error")
    error.wait_for(state="visible")
    assert message.lower() in error.inner_text().lower()
    assert page.locator("#layers").count() == 1  # the trace is still there
    assert page.locator("#worker-notice").count() == 0  # no "No live trace", which reads as a dead worker
    assert page.url == before  # the refused edit is not pushed into the URL
    page.locator("#intervene").fill("")
    page.locator("#run-trace").click()  # a good request clears the message
    page.wait_for_function("() => !document.querySelector('#intervene-error').textContent.trim()")
    assert page.locator("#layers").count() == 1


def test_a_bad_edit_in_a_shared_link_shows_next_to_the_field(page, server, index):
    response = page.goto(f"{server}/m/{index['slug']}/trace?text=Paris&intervene=L99K1")
    assert response.status == 400
    assert "layer 99" in page.locator("#intervene-error").inner_text().lower()
    assert page.locator("#intervene").input_value() == "L99K1"  # what was typed, to correct
    assert page.locator("#worker-notice").count() == 0


def test_the_search_box_refuses_what_the_server_refuses(page, server, index):
    slug = index["slug"]
    page.goto(f"{server}/m/{slug}/search")
    box = page.locator("#q")
    box.press_sequentially("Paris")
    page.wait_for_selector("#results table")
    box.fill("")
    box.press_sequentially("x" * 210)  # typing stops at the server's limit
    assert len(box.input_value()) == 200
    page.wait_for_function("() => new URL(location.href).searchParams.get('q') === 'x'.repeat(200)")
    # A client that sends more anyway (the box bypassed) sees the server's answer next to the field, and
    # the results of the previous query dimmed, not left as if they answered it.
    page.evaluate(
        "() => { const q = document.querySelector('#q'); q.value = 'y'.repeat(250);"
        " q.dispatchEvent(new Event('input', {bubbles: true})); }"
    )
    error = page.locator("#q-error")
    error.wait_for(state="visible")
    assert "at most 200 characters" in error.inner_text()
    assert "stale" in page.locator("#results").get_attribute("class")
    assert query(page)["q"] == ["x" * 200]  # the refused query is not the page's URL


def test_an_empty_label_is_refused_next_to_the_form_then_saved_undone_and_deleted(page, server, index):
    engine = make_engine(index["url"])
    with make_sessionmaker(engine)() as session:
        session.execute(Label.__table__.delete())
        session.commit()
    engine.dispose()
    page.goto(f"{server}/m/{index['slug']}/layers/1/keys/2")
    page.evaluate("() => { window.__marker = 1; }")
    page.locator("#label button[type=submit]", has_text="save label").click()
    error = page.locator("#pattern-error")
    error.wait_for(state="visible")
    assert "Give a pattern description" in error.inner_text()
    assert page.locator("h1").inner_text().startswith("Layer 1, key 2")  # the page is kept
    form = page.locator("form.label-form")
    form.locator("input[name=pattern]").fill("ends with a city")
    form.locator("input[name=author]").fill("ada")
    form.locator("button[type=submit]").click()
    page.wait_for_selector("#current-label", state="attached")
    assert "ends with a city" in page.locator("#current-label").inner_text()
    assert page.locator("form.label-form input[name=author]").input_value() == "ada"  # kept for the next one
    form = page.locator("form.label-form")
    form.locator("input[name=pattern]").fill("ends with a capital")
    form.locator("button[type=submit]").click()
    page.wait_for_function("() => document.querySelector('#current-label').textContent.includes('capital')")
    page.locator("#current-label form.delete-label button").click()  # undo: the label before it is back
    page.wait_for_function("() => document.querySelector('#current-label').textContent.includes('a city')")
    assert page.evaluate("() => window.__marker") == 1  # all without leaving the page
    page.reload()  # the author is remembered across pages
    assert page.locator("form.label-form input[name=author]").input_value() == "ada"
    page.locator("#current-label form.delete-label button").click()
    page.wait_for_selector("#current-label", state="detached")
    assert "No label yet" in page.locator("#label").inner_text()


# ---- state kept -----------------------------------------------------------------------------------


def test_filtering_a_layer_keeps_its_sort(page, server, index):
    slug = index["slug"]
    page.goto(f"{server}/m/{slug}/layers/1")
    page.locator("a.sort", has_text="max m").click()
    page.wait_for_url("**sort=max_coefficient**")
    assert query(page)["order"] == ["desc"]
    token = page.locator("table.keys tbody tr td.tokens code.tok").first.inner_text()
    page.locator("input[name=token]").fill(token)
    page.wait_for_url("**token=**")
    assert query(page)["sort"] == ["max_coefficient"] and query(page)["order"] == ["desc"]
    assert "sorted by max m (descending)" in page.locator("#keys p.count").inner_text()
    shown = [float(cell) for cell in page.locator("table.keys tbody tr td:nth-child(5)").all_inner_texts()]
    assert shown == sorted(shown, reverse=True) and len(shown) >= 1


def test_the_heatmap_mode_is_kept_and_in_the_url(page, server, index):
    slug = index["slug"]
    run_trace(page, server, slug)
    assert "heatmap" not in query(page)
    page.locator("#trace-heatmap .updatemenu-button", has_text="active memories").click()
    page.wait_for_function("() => new URL(location.href).searchParams.get('heatmap') === 'active'")
    visible = "() => document.getElementById('trace-heatmap').data.map(t => t.visible)"
    assert page.evaluate(visible) == [False, True]
    page.locator("#token-1").click()  # a new position: the trace is swapped, the mode stays
    page.wait_for_url("**position=1**")
    page.wait_for_selector("#token-1.selected")
    page.wait_for_selector("#trace-heatmap .main-svg")
    assert query(page)["heatmap"] == ["active"]
    assert page.evaluate(visible) == [False, True]
    page.reload()  # the URL alone gives the mode
    page.wait_for_selector("#trace-heatmap .main-svg")
    assert page.evaluate(visible) == [False, True]
    page.locator("#trace-heatmap .updatemenu-button", has_text="FF → logit").click()
    page.wait_for_function("() => !new URL(location.href).searchParams.has('heatmap')")


# ---- a corpus from the browser --------------------------------------------------------------------


def test_upload_a_corpus_and_see_its_counts(page, server, index):
    page.goto(f"{server}/corpora")
    text = "The first line.\n\nA second line.\n" + "x" * 10_001 + "\nThe last line.\n"
    page.locator("#file").set_input_files(
        {"name": "my notes.txt", "mimeType": "text/plain", "buffer": text.encode()}
    )
    page.locator("#upload button[type=submit]").click()
    result = page.locator("#upload-result")
    result.wait_for()
    shown = result.inner_text()
    assert "my notes.txt" in shown and "3 usable lines" in shown
    assert "1 blank" in shown and "1 longer than 10,000 characters" in shown
    assert page.locator("#corpus-files tbody tr", has_text="my notes.txt").count() == 1
    stored = page.locator("#upload-result input[name=corpus]").get_attribute("value")
    assert stored.endswith("-my_notes.txt") and str(index["uploads"].resolve()) in stored
    page.goto(server)  # the home page's index form offers it
    assert page.locator(f"#corpus-choices option[value='{stored}']").count() == 1


def test_an_unusable_upload_is_refused_next_to_the_field(page, server, index):
    page.goto(f"{server}/corpora")
    page.locator("#file").set_input_files(
        {"name": "picture.txt", "mimeType": "text/plain", "buffer": bytes(range(256)) * 40}
    )
    page.locator("#upload button[type=submit]").click()
    error = page.locator("#file-error")
    error.wait_for(state="visible")
    assert "picture.txt is not UTF-8 text" in error.inner_text()
    assert page.locator("h1").inner_text() == "Corpora"  # the page is kept


def test_a_file_over_the_limit_is_refused_before_it_is_sent(browser, index, worker):
    app = create_app(explorer(index, worker, max_upload_bytes=1000))
    with serving(app) as port:
        page = browser.new_page()
        requests: list[str] = []
        page.on("request", lambda request: requests.append(request.method))
        page.goto(f"http://127.0.0.1:{port}/corpora")
        page.locator("#file").set_input_files(
            {"name": "big.txt", "mimeType": "text/plain", "buffer": b"A sentence.\n" * 200}
        )
        assert "accepts at most 1,000" in page.locator("#file-error").inner_text()
        page.locator("#upload button[type=submit]").click()
        page.wait_for_timeout(300)
        assert "POST" not in requests
        page.close()
    app.state.engine.dispose()


# ---- phone widths (and a small laptop's): no page scrolls sideways --------------------------------

PAGES = {
    "home": "/",
    "model": "/m/{slug}",
    "layer": "/m/{slug}/layers/1?sort=max_coefficient&order=desc",
    "key": "/m/{slug}/layers/2/keys/3",
    "search": "/m/{slug}/search?q=Paris",
    "live view": "/m/{slug}/trace?text=The+capital+of+France+is+a+city+with+a+very+long+name&generate=3",
    "ablation": "/m/{slug}/layers/2/keys/3/ablation",
    "analysis": "/m/{slug}/analysis",
    "jobs": "/jobs",
    "job": "/jobs/{job}",
    "corpora": "/corpora",
    "login": "/login",
    "error": "/m/{slug}/layers/99",
}


@pytest.mark.parametrize("kind", list(PAGES))
def test_no_page_scrolls_sideways_on_a_phone(phone, server, index, kind):
    phone.goto(server + PAGES[kind].format(slug=index["slug"], job=index["job"]))
    phone.wait_for_load_state("networkidle")
    if phone.locator(".chart").count():
        phone.wait_for_selector(".chart .main-svg")  # charts drawn: they must fit too
    width, client = no_sideways_scroll(phone)
    assert client == phone.viewport_size["width"]
    assert width <= client, f"{kind}: the page is {width} px wide at {client} px"
    header_box = phone.locator("header form.searchbox input")
    if header_box.count():  # the header's search box fits on the screen, not clipped
        box = header_box.bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= client and box["width"] >= 150, kind
    # A wide table scrolls inside its own box: no table (but those inside another) reaches past the screen.
    rights = phone.evaluate(
        "() => [...document.querySelectorAll('main table')].filter(t => !t.parentElement.closest('table'))"
        ".map(t => t.getBoundingClientRect().right)"
    )
    assert all(right <= client + 1 for right in rights), (kind, rights)


LONG_WORD = "Supercalifragilistic" * 15  # 300 characters, no place to break
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_long_unbroken_labels_and_explanations_wrap_on_a_phone(phone, server, index):
    """Issue 39: a label or an explanation of one long word made the page (or its table) scroll sideways at
    390 px; they wrap (overflow-wrap: anywhere) wherever they show."""
    slug, engine = index["slug"], make_engine(index["url"])
    sessions = make_sessionmaker(engine)
    with sessions() as session:
        model_id = session.scalars(select(LanguageModel.id)).one()
        session.add(
            Label(
                model_id=model_id,
                layer=2,
                key=3,
                pattern=LONG_WORD,
                tag="",
                author=LONG_WORD[:60],
                created_at=NOW,
            )
        )
        explanation = session.scalars(
            select(Explanation).where(Explanation.layer == 2, Explanation.key == 3)
        ).one()
        kept, explanation.text = explanation.text, f"strongest at {LONG_WORD}"
        run_id = explanation.run_id
        session.commit()
    try:
        for url, boxes in (
            (f"/m/{slug}/layers/2/keys/3", "#current-label, #explanation-text"),
            (f"/m/{slug}/labels", "#labels"),
            (f"/m/{slug}/search?q=Supercali", "#label-matches, #explanation-matches"),
        ):
            phone.goto(server + url)
            width, client = no_sideways_scroll(phone)
            assert width <= client, f"{url}: the page is {width} px wide at {client} px"
            shown = phone.evaluate(
                f"() => [...document.querySelectorAll('{boxes}')].map(e => [e.scrollWidth, e.clientWidth, "
                "e.getBoundingClientRect().right])"
            )
            assert len(shown) == boxes.count(",") + 1, url
            assert all(scroll <= inner + 1 and right <= client + 1 for scroll, inner, right in shown), (
                url,
                shown,
            )
    finally:
        with sessions() as session:
            session.execute(Label.__table__.delete())
            session.get(Explanation, (run_id, 2, 3)).text = kept
            session.commit()
        engine.dispose()


def test_a_jobs_long_error_wraps_on_a_phone(page, server, index):
    """Issue 39: a job's error is body text that wraps: a long URL in it made the phone page 754 px wide.
    Its earlier attempt's error and its opened traceback fit too."""
    long_url = (
        "https://huggingface.co/" + "a-model-with-a-very-long-name-" * 6 + "/resolve/main/model.safetensors"
    )
    engine = make_engine(index["url"])
    sessions = make_sessionmaker(engine)
    with sessions() as session:
        job, _ = jobs.enqueue(
            session=session, spec=RunSpec.from_settings(Settings(), model="org/" + "m" * 60)
        )
        error = OSError(f"cannot download {long_url}: 404")
        for attempt in (1, 2):  # a failed attempt, queued again, failed again
            if attempt == 2:
                jobs.retry(session=session, job_id=job.id)
            lease = timedelta(minutes=2)
            jobs.claim_job(session=session, worker="w", lease=lease, max_attempts=3, job_id=job.id)
            jobs.fail_job(session=session, job_id=job.id, error=error)
        session.commit()
        job_id = job.id
    try:
        page.set_viewport_size({"width": 390, "height": 844})
        page.goto(f"{server}/jobs/{job_id}")
        assert long_url in page.locator("section.error").inner_text()
        page.locator("section.error summary").click()
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
    finally:
        with sessions() as session:
            session.execute(delete(Job).where(Job.id == job_id))
            session.commit()
        engine.dispose()
