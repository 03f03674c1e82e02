"""Issue 26 (2, 4): a prompt or text too long for a URL goes as a form (POST) to the live view and to a key
page's "try your own text", with their JSON twins: the same answer as the GET, up to the box's limit
(which is the server's), a 413 past it, the live budget spent as a GET spends it."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from ffmem.config import Settings
from ffmem.engine.live.protocol import text_max_length
from ffmem.web.main import create_app
from ffmem.web.worker_client import LiveWorker
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

PROMPT = "The capital of France is"
LONG = "The capital of France is Paris. The capital of France is"  # 60 bytes as a query: over 40
pytestmark = pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")


@pytest.fixture(scope="module")
def make(explorer_db, tiny, tiny_model_dir):
    """make(**settings) → a client of the explorer on the tiny index, its live worker in-process."""
    live = Live(device="cpu", max_tokens=56, queue=4)
    live.models[str(tiny_model_dir)] = tiny
    worker = TestClient(create_live_app(live), base_url="http://worker")
    apps = []

    def start(**settings) -> TestClient:
        settings = {"trace_rate_limit": "0"} | settings
        app = create_app(
            Settings(database_url=explorer_db, **settings),
            live=LiveWorker("http://worker", 30, client=worker),
        )
        apps.append(app)
        return TestClient(app)

    yield start
    for app in apps:
        app.state.engine.dispose()


def without_link(body: dict) -> dict:
    return {name: value for name, value in body.items() if name != "link"}


def test_a_prompt_too_long_for_a_url_is_traced_by_post(make, slug):
    roomy, tight = make(), make(max_query_bytes=40)
    form = {"text": LONG, "memories": "5", "intervene": "L1K4"}
    refused = tight.get(f"/m/{slug}/trace.json", params=form)
    assert refused.status_code == 414
    assert refused.json() == {
        "ok": False,
        "status": 414,
        "error": "The query string is longer than 40 bytes, the most this server accepts; shorten it, or "
        "send a long prompt or text as a form (POST).",
    }
    expected = roomy.get(f"/m/{slug}/trace.json", params=form).json()
    assert expected["link"] == f"/m/{slug}/trace?text={LONG.replace(' ', '+')}&intervene=L1K4&memories=5"
    posted = tight.post(f"/m/{slug}/trace.json", data=form)
    assert posted.status_code == 200
    body = posted.json()
    assert body["link"] is None  # no share link: the URL would be refused
    assert without_link(body) == without_link(expected) and body["layers"] and body["edits"]
    assert roomy.post(f"/m/{slug}/trace.json", data=form).json() == expected  # short enough: a link too
    page = tight.post(f"/m/{slug}/trace", data=form)
    assert page.status_code == 200 and 'id="layers"' in page.text
    assert (
        f">{LONG}</textarea>" in page.text and 'id="no-link"' in page.text and "share-link" not in page.text
    )
    assert 'data-max-query="40"' in page.text  # the page sends longer requests as forms (static/app.js)
    fragment = tight.post(f"/m/{slug}/trace", data=form, headers={"HX-Request": "true", "HX-Target": "trace"})
    assert fragment.status_code == 200 and "<html" not in fragment.text and 'id="layers"' in fragment.text


def test_the_box_holds_what_the_server_accepts(make, slug, tiny):
    """16,384 characters (512 tokens × 32) reach the worker even at 12 bytes each as a form; one more is
    refused before it, and a larger body at the door (413)."""
    client = make()
    limit = text_max_length(512)
    assert limit == 16384
    assert f'maxlength="{limit}"' in client.get(f"/m/{slug}/trace").text
    widest = "\U0001d538" * limit  # 𝔸: 4 bytes of UTF-8, 12 percent-encoded
    answer = client.post(f"/m/{slug}/trace.json", data={"text": widest})
    tokens = len(tiny.tokenizer(widest).input_ids)
    assert answer.status_code == 400
    assert answer.json() == {
        "ok": False,
        "status": 400,
        "error": f"The prompt has {tokens} tokens; the limit is 56 (max_prompt_tokens).",
    }
    page = client.post(f"/m/{slug}/trace", data={"text": widest})  # the page too: the form again, the reason
    assert (
        page.status_code == 400
        and f"The prompt has {tokens} tokens" in page.text
        and 'id="prompt"' in page.text
    )
    over = client.post(f"/m/{slug}/trace.json", data={"text": "a" * (limit + 1)})
    assert over.json() == {"ok": False, "status": 400, "error": "Prompts are limited to 512 tokens."}
    text = client.post(f"/m/{slug}/layers/1/keys/4.json", data={"text": "a" * (limit + 1)})
    assert text.json() == {"ok": False, "status": 400, "error": "Texts are limited to 512 tokens."}
    huge = client.post(f"/m/{slug}/trace.json", data={"text": "a" * 300_000})
    assert huge.status_code == 413
    assert huge.json() == {
        "ok": False,
        "status": 413,
        "error": "The request body is larger than 204,800 bytes, the most this server accepts.",
    }


def test_a_key_pages_text_too_long_for_a_url_is_read_by_post(make, slug):
    roomy, tight = make(), make(max_query_bytes=40)
    url = f"/m/{slug}/layers/1/keys/4"
    assert tight.get(f"{url}.json", params={"text": LONG}).status_code == 414
    expected = roomy.get(f"{url}.json", params={"text": LONG}).json()
    posted = tight.post(f"{url}.json", data={"text": LONG})
    assert posted.status_code == 200
    assert posted.json()["try_text"] == expected["try_text"]  # (links.random differs, by design)
    assert posted.json()["triggers"] == expected["triggers"]
    assert expected["try_text"]["text"] == LONG and expected["try_text"]["shaded"]["tokens"]
    pinned = tight.post(f"{url}.json?triggers=2", data={"text": LONG}).json()
    assert len(pinned["triggers"]) == 2  # the page's own query parameters stay in the URL
    headers = {"HX-Request": "true", "HX-Target": "try_text"}
    fragment = tight.post(url, data={"text": LONG}, headers=headers)
    assert fragment.status_code == 200
    assert fragment.text.lstrip().startswith('<div id="try_text" class="try-answer" data-stale-on-error>')
    assert 'id="try-text-shaded"' in fragment.text


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/trace.json", "The prompt is empty: type some text."),
        ("/layers/1/keys/4.json", "The text is empty: type some text."),
    ],
)
def test_an_empty_posted_text_is_refused(make, slug, path, message):
    client = make()
    for form in ({"text": ""}, {"text": "   "}, {}):
        answer = client.post(f"/m/{slug}{path}", data=form)
        assert answer.status_code == 400, form
        assert answer.json() == {"ok": False, "status": 400, "error": message}


def test_a_posted_text_spends_the_live_budget(make, slug):
    client = make(trace_rate_limit="3/minute")
    assert client.post(f"/m/{slug}/trace.json", data={"text": PROMPT}).status_code == 200
    assert client.get(f"/m/{slug}/trace.json", params={"text": PROMPT}).status_code == 200
    assert client.post(f"/m/{slug}/layers/1/keys/4.json", data={"text": PROMPT}).status_code == 200
    refused = client.post(f"/m/{slug}/trace.json", data={"text": PROMPT})
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"].startswith("Live traces and tests are limited to 3 per minute per client")
    assert client.post(f"/m/{slug}/layers/1/keys/4.json", data={"text": PROMPT}).status_code == 429
