"""Getting around a wide layer (issue 29, item 4) on the tiny index, SQLite and Postgres: a key opened by its
number (`?key=N`: a 303 to its page or twin, run pinned), any page reached from the pager's box with the
sort, order, filter and page size it had, and the pager's links keeping the page size."""

from __future__ import annotations

from html.parser import HTMLParser
from urllib.parse import parse_qsl, urlsplit


class FormInputs(HTMLParser):
    """The action and the named inputs (name → value) of the form with id `form_id`."""

    def __init__(self, form_id: str) -> None:
        super().__init__()
        self.form_id, self.inside, self.action, self.inputs = form_id, False, None, {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "form" and attrs.get("id") == self.form_id:
            self.inside, self.action = True, attrs["action"]
        elif tag == "input" and self.inside and attrs.get("name"):
            self.inputs[attrs["name"]] = attrs.get("value")

    def handle_endtag(self, tag):
        if tag == "form":
            self.inside = False


def form_of(html: str, form_id: str) -> tuple[str, dict]:
    parser = FormInputs(form_id)
    parser.feed(html)
    assert parser.action is not None, f"no form #{form_id}"
    return parser.action, parser.inputs


def test_a_key_opens_by_its_number(client, slug, run):
    answer = client.get(f"/m/{slug}/layers/1", params={"key": 40}, follow_redirects=False)
    assert (answer.status_code, answer.headers["location"]) == (303, f"/m/{slug}/layers/1/keys/40")
    pinned = client.get(f"/m/{slug}/layers/1.json", params={"key": 40, "run": run.id}, follow_redirects=False)
    assert (pinned.status_code, pinned.headers["location"]) == (
        303,
        f"/m/{slug}/layers/1/keys/40.json?run={run.id}",
    )
    assert client.get(pinned.headers["location"]).json()["key"] == 40
    missing = client.get(f"/m/{slug}/layers/1.json", params={"key": 48}, follow_redirects=False)
    assert missing.status_code == 404
    assert missing.json() == {
        "ok": False,
        "status": 404,
        "error": "Layer 1 has keys 0–47; there is no key 48.",
    }
    assert client.get(f"/m/{slug}/layers/1.json", params={"key": -1}).status_code == 400


def test_a_key_the_layer_lacks_stays_on_the_layer_page_beside_the_box(client, slug, run):
    """Issue 39: Enter on a key past the layer's last gave an error page; the layer page stays, the reason
    next to its box, the number kept (its JSON twin: the error alone, as before)."""
    answer = client.get(f"/m/{slug}/layers/1", params={"key": 99999, "run": run.id}, follow_redirects=False)
    assert answer.status_code == 404 and "<h1>Layer 1 " in answer.text and "<h1>404" not in answer.text
    reason = "Layer 1 has keys 0–47; there is no key 99999."
    assert f'<span class="field-error" id="key-error" role="alert">{reason}</span>' in answer.text
    assert form_of(answer.text, "open-key")[1] == {"key": "99999", "run": str(run.id)}
    assert 'id="keys"' in answer.text  # the layer's keys, as without the box


def test_the_layer_page_offers_the_key_box(client, slug, run):
    action, inputs = form_of(client.get(f"/m/{slug}/layers/2").text, "open-key")
    assert (action, inputs) == (f"/m/{slug}/layers/2", {"key": None, "run": str(run.id)})


def test_the_page_box_keeps_sort_order_filter_and_page_size(client, slug, run):
    query = {"sort": "max_coefficient", "order": "desc", "per_page": 7, "page": 2}
    html = client.get(f"/m/{slug}/layers/1", params=query).text
    action, inputs = form_of(html, "page-jump")
    assert action == f"/m/{slug}/layers/1"
    expected = {"page": "2", "sort": "max_coefficient", "order": "desc", "per_page": "7", "run": str(run.id)}
    assert inputs == expected
    jumped = client.get(f"{action}.json", params=inputs | {"page": "5"}).json()
    direct = client.get(f"/m/{slug}/layers/1.json", params=query | {"page": 5}).json()
    assert jumped["keys"] == direct["keys"] and (jumped["page_number"], jumped["per_page"]) == (5, 7)
    every = client.get(
        f"/m/{slug}/layers/1.json", params={"sort": "max_coefficient", "order": "desc", "per_page": 48}
    )
    assert [k["key"] for k in jumped["keys"]] == [k["key"] for k in every.json()["keys"][28:35]]


def test_the_pager_links_keep_the_page_size(client, slug, run):
    html = client.get(f"/m/{slug}/layers/1", params={"per_page": 10, "sort": "density"}).text
    nexts = [part for part in html.split('href="')[1:] if "next ›" in part.split("</a>")[0]]
    assert nexts, "a next link"
    link = nexts[0].split('"')[0].replace("&amp;", "&")
    assert dict(parse_qsl(urlsplit(link).query)) == {
        "sort": "density",
        "order": "asc",
        "page": "2",
        "per_page": "10",
        "run": str(run.id),
    }


def test_one_page_has_no_page_box(client, slug):
    assert 'id="page-jump"' not in client.get(f"/m/{slug}/layers/1", params={"per_page": 500}).text
