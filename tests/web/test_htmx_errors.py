"""Issue 26 (3, 4 and every htmx panel): an error answered to htmx is the message alone, marked so that the
page shows it next to its field or before the element the answer was going to — never in that element's
place (static/app.js; tests/browser/test_htmx_panels_browser.py sees it in Chromium) — and a search as you
type never jumps to a key: only sending the form does."""

from __future__ import annotations

import pytest

# Both backends: errors raised by each backend's driver.
pytestmark = pytest.mark.backends("sqlite", "postgres")

HTMX = {"HX-Request": "true"}


def message_headers(answer, field: str | None = None) -> None:
    assert answer.headers["x-error-message"] == "true" and answer.headers["hx-reswap"] == "innerHTML"
    assert answer.headers["hx-push-url"] == "false"
    assert answer.headers.get("x-error-field") == field
    assert "<html" not in answer.text and answer.text.count('class="error-message"') == 1


def test_a_refused_query_answers_htmx_with_the_message_alone(client, slug):
    answer = client.get(
        f"/m/{slug}/search", params={"q": "x" * 9000}, headers=HTMX | {"HX-Target": "results"}
    )
    assert answer.status_code == 414
    message_headers(answer)
    assert "<strong>Query too long</strong>: The query string is longer than 8,192 bytes" in answer.text


def test_an_unknown_page_answers_htmx_with_the_message_alone(client, slug):
    answer = client.get(f"/m/{slug}/layers/1/keys/4/nope", headers=HTMX | {"HX-Target": "samples"})
    assert answer.status_code == 404
    message_headers(answer)
    assert "<strong>Not found</strong>: No page at this address." in answer.text


@pytest.mark.parametrize("q", ["L1 K4", "L1 K45", "1/45"])
def test_typing_a_key_shows_it_and_only_sending_the_form_opens_it(client, slug, q):
    layer, key = (1, 4) if q == "L1 K4" else (1, 45)
    url = f"/m/{slug}/layers/{layer}/keys/{key}"
    typed = client.get(f"/m/{slug}/search", params={"q": q}, headers=HTMX | {"HX-Target": "results"})
    assert typed.status_code == 200 and "location" not in typed.headers
    assert typed.text.lstrip().startswith('<section id="results" data-stale-on-error>')
    assert f'<p id="key-jump"><a href="{url}">{q}</a>: press Enter to open this key.</p>' in typed.text
    sent = client.get(f"/m/{slug}/search", params={"q": q}, follow_redirects=False)
    assert sent.status_code == 303 and sent.headers["location"] == url
    assert (
        client.get(f"/m/{slug}/search.json", params={"q": q}, follow_redirects=False).headers["location"]
        == f"{url}.json"
    )


@pytest.mark.parametrize(
    ("q", "message"),
    [
        ("L99 K1", "{slug} has layers 0–2; there is no layer 99."),
        ("L3 K1", "{slug} has layers 0–2; there is no layer 3."),
        ("L1 K48", "Layer 1 has keys 0–47; there is no key 48."),
    ],
)
def test_a_key_the_model_lacks_is_a_404_next_to_the_search_box(client, slug, q, message):
    message = message.format(slug=slug)
    typed = client.get(f"/m/{slug}/search", params={"q": q}, headers=HTMX | {"HX-Target": "results"})
    assert typed.status_code == 404
    message_headers(typed, field="q")
    assert f"</strong>: {message}</span>" in typed.text
    twin = client.get(f"/m/{slug}/search.json", params={"q": q})
    assert twin.status_code == 404 and twin.json() == {"ok": False, "status": 404, "error": message}
    page = client.get(
        f"/m/{slug}/search", params={"q": q}
    )  # Enter: the search page, the reason beside its box
    assert page.status_code == 404 and f"<h1>Search {slug}</h1>" in page.text and "<h1>404" not in page.text
    assert f'<span class="field-error" id="q-error" role="alert">{message}</span>' in page.text
    assert f'name="q" value="{q}"' in page.text and 'id="key-jump"' not in page.text


def test_the_search_form_searches_as_you_type_and_jumps_only_when_sent(client, slug):
    page = client.get(f"/m/{slug}/search").text
    assert 'hx-trigger="input changed delay:250ms, change from:select">' in page  # no `submit`: Enter loads
