"""Per-client rate limits on the live routes (ffmem/web/ratelimit.py), on the tiny index and a real live
worker in-process: the request past the limit is a 429 with Retry-After in the one error shape (the trace form
with the notice on the page), other clients and the browse pages are unaffected, the window frees
again. The `limits` library's clock is frozen where the numbers are checked exactly."""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import limits.storage.memory
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from typer.testing import CliRunner
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

import ffmem.web.ratelimit
from ffmem.cli import cli
from ffmem.config import Settings, get_settings
from ffmem.web.main import create_app
from ffmem.web.ratelimit import LiveLimit
from ffmem.web.worker_client import LiveWorker
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

PROMPT = "The capital of France is"
pytestmark = pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")


def limited(rates: str, wait: int) -> str:
    return (
        f"Live traces and tests are limited to {rates} per client; try again in {wait} s. "
        "The browse pages and search are not limited."
    )


class CountingWorker(LiveWorker):
    """The web process's worker client, counting the requests that reach the worker."""

    calls = 0

    def _post(self, path: str, payload, timeout: float | None = None) -> dict:
        self.calls += 1
        return super()._post(path, payload, timeout)


@pytest.fixture(scope="module")
def live(tiny, tiny_model_dir):
    live = Live(device="cpu", max_tokens=56, queue=4)
    live.models[str(tiny_model_dir)] = tiny
    return live


@pytest.fixture
def make_app(explorer_db, live):
    """make_app(limit): a fresh explorer (its own counts) with `trace_rate_limit=limit`."""
    apps = []

    def make(limit: str):
        worker = TestClient(create_live_app(live), base_url="http://worker")
        counting = CountingWorker("http://worker", 30, client=worker)
        app = create_app(Settings(database_url=explorer_db, trace_rate_limit=limit), live=counting)
        apps.append(app)
        return app

    yield make
    for made in apps:
        made.state.engine.dispose()


@pytest.fixture
def clock(monkeypatch):
    """The limits library's clock (and the Retry-After's), frozen at a whole second; move `clock.now`."""
    clock = SimpleNamespace(now=float(int(time.time())))
    frozen = SimpleNamespace(time=lambda: clock.now)
    monkeypatch.setattr(limits.storage.memory, "time", frozen)
    monkeypatch.setattr(ffmem.web.ratelimit, "time", frozen)
    return clock


def trace(client: TestClient, slug: str, **headers):
    return client.get(f"/m/{slug}/trace.json", params={"text": PROMPT, "memories": 1}, headers=headers)


def test_the_fourth_trace_is_a_429_with_retry_after_until_the_window_frees(make_app, slug, clock):
    app = make_app("3/minute")
    client = TestClient(app, client=("10.0.0.1", 1000))
    start = clock.now
    for offset in (0, 10, 20):
        clock.now = start + offset
        response = trace(client, slug)
        assert response.status_code == 200 and response.json()["prediction"]["token_id"] >= 0
    clock.now = start + 30  # the slot of the first trace (t=0) frees after t=60
    refused = trace(client, slug)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "31"
    assert refused.json() == {"ok": False, "error": limited("3 per minute", 31), "status": 429}
    assert app.state.live.calls == 3  # the refused one never reached the worker
    clock.now = start + 59
    assert trace(client, slug).headers["retry-after"] == "2"  # refusals are not counted
    clock.now = start + 60.5
    assert trace(client, slug).status_code == 200
    clock.now = start + 61
    refused = trace(client, slug)  # now t=10, 20 and 60.5 fill the window: the next slot at t=70
    assert refused.status_code == 429 and refused.headers["retry-after"] == "10"
    assert app.state.live.calls == 4


def test_other_clients_and_the_browse_pages_are_not_limited(make_app, slug, clock):
    app = make_app("1/minute")
    first = TestClient(app, client=("10.0.0.1", 1000))
    assert trace(first, slug).status_code == 200
    assert trace(first, slug).status_code == 429
    ablation = first.get(f"/m/{slug}/layers/1/keys/4/ablation.json", params={"triggers": 2})
    assert ablation.status_code == 429  # one budget for all the live routes
    assert ablation.json() == {"ok": False, "error": limited("1 per minute", 61), "status": 429}
    tried = first.get(f"/m/{slug}/layers/1/keys/4.json", params={"text": PROMPT})  # try your own text
    assert tried.status_code == 429 and tried.json()["error"] == limited("1 per minute", 61)
    browse = [
        "/",
        "/.json",
        f"/m/{slug}",
        f"/m/{slug}.json",
        f"/m/{slug}/layers/1.json",
        f"/m/{slug}/layers/1/keys/4",
        f"/m/{slug}/layers/1/keys/4.json",
        f"/m/{slug}/search.json?q=Paris&limit=20",  # within the stored depth: the worker is not asked
    ]
    for path in browse:
        assert first.get(path).status_code == 200, path
    second = TestClient(app, client=("10.0.0.2", 123))
    assert trace(second, slug).status_code == 200
    assert trace(second, slug).status_code == 429
    assert app.state.live.calls == 2


def test_the_page_answers_with_the_form_and_the_notice(make_app, slug, clock):
    app = make_app("1/minute")
    client = TestClient(app, client=("10.0.0.1", 1000))
    assert client.get(f"/m/{slug}/trace", params={"text": PROMPT}).status_code == 200
    notice = f"<strong>No live trace</strong> — Too many live requests: {limited('1 per minute', 61)}"
    page = client.get(f"/m/{slug}/trace", params={"text": PROMPT})
    assert page.status_code == 429 and page.headers["retry-after"] == "61"
    assert "<html" in page.text and 'id="prompt"' in page.text and notice in page.text
    fragment = client.get(
        f"/m/{slug}/trace", params={"text": PROMPT}, headers={"HX-Request": "true", "HX-Target": "trace"}
    )
    assert fragment.status_code == 429 and "<html" not in fragment.text and notice in fragment.text
    # htmx takes the first responseHandling rule whose regex matches the status: the page's swaps a 429 in.
    meta = re.search(r"<meta name=\"htmx-config\" content='([^']*)'>", page.text).group(1)
    rule = next(r for r in json.loads(meta)["responseHandling"] if re.search(r["code"], "429"))
    assert rule == {"code": "[45]..", "swap": True, "error": True}
    ablation = client.get(f"/m/{slug}/layers/1/keys/4/ablation")  # the page at once; its result: refused
    assert ablation.status_code == 200 and 'id="ablation-computing"' in ablation.text
    result = client.get(
        f"/m/{slug}/layers/1/keys/4/ablation", headers={"HX-Request": "true", "HX-Target": "ablation"}
    )
    assert result.status_code == 429 and result.headers["retry-after"] == "61"
    assert "<html" not in result.text and limited("1 per minute", 61) in result.text


def test_a_burst_limit_beside_the_steady_one(make_app, slug, clock):
    app = make_app("5/minute;2/second")
    client = TestClient(app, client=("10.0.0.1", 1000))
    start = clock.now
    assert [trace(client, slug).status_code for _ in range(3)] == [200, 200, 429]
    assert trace(client, slug).json()["error"] == limited("2 per second", 2)
    clock.now = start + 1.5
    assert [trace(client, slug).status_code for _ in range(3)] == [200, 200, 429]
    clock.now = start + 3  # the 5th of the minute; the 6th waits for t=0's slot: 57 s
    assert [trace(client, slug).status_code for _ in range(2)] == [200, 429]
    refused = trace(client, slug)
    assert refused.headers["retry-after"] == "58"
    assert refused.json()["error"] == limited("5 per minute", 58)
    assert app.state.live.calls == 5


def test_retry_after_is_honest_on_the_real_clock(make_app, slug):
    client = TestClient(make_app("2/second"), client=("10.0.0.1", 1000))
    assert [trace(client, slug).status_code for _ in range(2)] == [200, 200]
    refused = trace(client, slug)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    time.sleep(int(refused.headers["retry-after"]))
    assert trace(client, slug).status_code == 200


def test_behind_a_trusted_proxy_the_forwarded_address_counts(make_app, slug, clock):
    """What `ffmem serve --forwarded-allow-ips` sets up: uvicorn's proxy-headers middleware."""
    app = ProxyHeadersMiddleware(make_app("1/minute"), trusted_hosts="10.0.0.9")
    proxy = TestClient(app, client=("10.0.0.9", 1000))
    assert trace(proxy, slug, **{"X-Forwarded-For": "203.0.113.5"}).status_code == 200
    assert trace(proxy, slug, **{"X-Forwarded-For": "203.0.113.5"}).status_code == 429
    assert trace(proxy, slug, **{"X-Forwarded-For": "203.0.113.6"}).status_code == 200
    stranger = TestClient(app, client=("10.0.0.3", 1000))  # not trusted: its header is ignored
    assert trace(stranger, slug, **{"X-Forwarded-For": "203.0.113.7"}).status_code == 200
    assert trace(stranger, slug, **{"X-Forwarded-For": "203.0.113.8"}).status_code == 429


@pytest.mark.parametrize("spec", ["0", "", " "])
def test_zero_or_empty_turns_the_limit_off(spec):
    limit = LiveLimit(spec)
    assert [limit.spend("10.0.0.1") for _ in range(1000)] == [None] * 1000


def test_an_unreadable_limit_fails_at_start():
    with pytest.raises(ValidationError, match="couldn't parse rate limit string 'lots'"):
        Settings(_env_file=None, trace_rate_limit="lots")
    assert Settings(_env_file=None).trace_rate_limit == "30/minute"


@pytest.mark.parametrize(
    ("option", "proxy_headers", "trusted"),
    [
        ([], True, "127.0.0.1"),
        (["--forwarded-allow-ips", "10.0.0.9,10.1.0.0/16"], True, "10.0.0.9,10.1.0.0/16"),
        (["--forwarded-allow-ips", ""], False, None),
    ],
)
def test_serve_tells_uvicorn_which_proxies_to_trust(tmp_path, monkeypatch, option, proxy_headers, trusted):
    import uvicorn

    started = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: started.update(options))
    monkeypatch.setattr("ffmem.cli.serve.signal.signal", lambda *args: None)
    monkeypatch.delenv("FFMEM_FORWARDED_ALLOW_IPS", raising=False)
    get_settings.cache_clear()
    url = f"sqlite:///{tmp_path / 'serve.db'}"
    result = CliRunner().invoke(cli, ["serve", "--db", url, "--worker-url", "http://127.0.0.1:9", *option])
    get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    assert (started["proxy_headers"], started["forwarded_allow_ips"]) == (proxy_headers, trusted)


def test_the_ablation_page_renders_at_once_and_htmx_loads_its_result(make_app, slug, run):
    """Issue 39 (5): the page computed before it answered, so the browser showed nothing for seconds. Now it
    answers without the worker (and spends no live request): its heading and a busy region whose result htmx
    asks on load; the result (the fragment) and the JSON twin ask the worker."""
    app = make_app("1/minute")
    client = TestClient(app, client=("10.0.0.3", 1000))
    url = f"/m/{slug}/layers/1/keys/4/ablation"
    page = client.get(url, params={"triggers": 3})
    assert page.status_code == 200 and app.state.live.calls == 0
    result = f"{url}?run={run.id}&amp;triggers=3"
    region = f'<div id="ablation" aria-live="polite" hx-get="{result}" hx-trigger="load" hx-swap="innerHTML">'
    assert "<h1>Layer 1, key 4, switched off</h1>" in page.text and region in page.text
    busy = '<p id="ablation-computing" class="computing" role="status" aria-busy="true">'
    assert busy in page.text and 'class="ablation"' not in page.text  # no result yet
    assert client.get(url).status_code == 200 and app.state.live.calls == 0  # pages spend no live request
    htmx = {"HX-Request": "true", "HX-Target": "ablation"}
    fragment = client.get(result.replace("&amp;", "&"), headers=htmx)
    assert fragment.status_code == 200 and app.state.live.calls == 1
    assert "<html" not in fragment.text and "ablation-computing" not in fragment.text
    assert fragment.text.count("<tr>") == 1 + 3  # the head and the 3 prefixes
    twin = client.get(f"{url}.json", params={"triggers": 3})
    assert twin.status_code == 429  # the result spent this minute's one live request
