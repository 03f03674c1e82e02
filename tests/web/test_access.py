"""Write access (ffmem/web/access.py): browsing is open; every write needs the admin token (a header or the
signed cookie of /login) — or, without a token, a client on the machine of a server bound to 127.0.0.1 that
no proxy passed the request on for; read-only refuses all."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from ffmem.config import Settings
from ffmem.store.models import Job, Label, MemoryList, Run
from ffmem.web.main import create_app

# Both backends: write access: tokens and labels are stored.
pytestmark = pytest.mark.backends("sqlite", "postgres")

TOKEN = "s3cret-token"
LABEL = {"pattern": "ends with a city", "tag": "semantic"}
# POSTs that read: a live view's prompt or a key page's text sent as a form (too long for a URL)
LIVE_READS = ("/m/{model}/trace", "/m/{model}/layers/{layer}/keys/{key}")


@pytest.fixture
def serve(explorer_db, db):
    """serve(**settings) → a TestClient on the tiny index; labels are cleared before each test."""
    db.execute(Label.__table__.delete())
    db.commit()
    apps = []

    def start(**settings) -> TestClient:
        app = create_app(Settings(database_url=explorer_db, **settings))
        apps.append(app)
        return TestClient(app)

    yield start
    for app in apps:
        app.state.engine.dispose()


def labels(db) -> int:
    db.expire_all()
    return db.scalar(select(func.count()).select_from(Label))


def test_a_local_server_without_a_token_lets_its_machine_write(serve, db, slug):
    client = serve()
    assert client.post(f"/m/{slug}/layers/1/keys/4/labels.json", data=LABEL).status_code == 201
    page = client.get(f"/m/{slug}/layers/1/keys/4").text
    assert 'class="label-form"' in page and "Log in" not in page
    assert client.get("/login.json").json() | {"next": None} == {
        "page": "login", "title": "ffmem: log in", "can_write": True, "read_only": False,
        "token_set": False, "name": None, "reason": None, "next": None,
    }  # fmt: skip


def test_a_public_server_without_a_token_refuses_writes(serve, db, slug):
    client = serve(host="0.0.0.0")
    answer = client.post(f"/m/{slug}/layers/1/keys/4/labels.json", data=LABEL)
    assert answer.status_code == 403
    assert answer.json() == {
        "ok": False,
        "status": 403,
        "error": "This server listens on 0.0.0.0 and has no admin token, so it refuses writes. "
        "Set FFMEM_ADMIN_TOKEN and log in at /login, or serve on 127.0.0.1.",
    }
    assert labels(db) == 0
    page = client.get(f"/m/{slug}/layers/1/keys/4").text
    assert 'class="label-form"' not in page and "Log in" not in page  # no token: nothing to log in with
    assert client.get(f"/m/{slug}/layers/1/keys/4.json").status_code == 200  # browsing stays open


def test_the_token_in_a_header(serve, db, slug):
    client = serve(host="0.0.0.0", admin_token=TOKEN)
    url = f"/m/{slug}/layers/1/keys/4/labels.json"
    missing = client.post(url, data=LABEL)
    assert (missing.status_code, missing.headers["www-authenticate"]) == (401, "Bearer")
    assert missing.json()["error"] == (
        "Writing needs the admin token: log in at /login, or send it as `Authorization: Bearer <token>`."
    )
    wrong = client.post(url, data=LABEL, headers={"Authorization": "Bearer nope"})
    assert (wrong.status_code, wrong.json()["error"]) == (
        403, "The admin token sent does not match this server's."
    )  # fmt: skip
    assert labels(db) == 0
    assert client.post(url, data=LABEL, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 201
    assert client.post(url, data=LABEL, headers={"X-Admin-Token": TOKEN}).status_code == 201
    assert labels(db) == 2


def test_logging_in_sets_a_signed_cookie_that_names_the_author(serve, db, slug):
    client = serve(host="0.0.0.0", admin_token=TOKEN)
    key = f"/m/{slug}/layers/1/keys/4"
    before = client.get(key).text
    assert 'class="label-form"' not in before and f'href="/login?next={key.replace("/", "%2F")}"' in before
    wrong = client.post("/login", data={"token": "nope", "next": key}, follow_redirects=False)
    assert wrong.status_code == 403 and "ffmem_admin" not in wrong.headers.get("set-cookie", "")
    answer = client.post("/login", data={"token": TOKEN, "name": "ada", "next": key}, follow_redirects=False)
    assert (answer.status_code, answer.headers["location"]) == (303, key)
    cookie = answer.headers["set-cookie"]
    assert cookie.startswith("ffmem_admin=") and "HttpOnly" in cookie and "SameSite=strict" in cookie
    page = client.get(key).text
    assert 'class="label-form"' in page and 'value="ada"' in page
    added = client.post(f"{key}/labels.json", data=LABEL)
    assert added.status_code == 201 and added.json()["label"]["author"] == "ada"
    state = client.get("/login.json").json()
    assert (state["can_write"], state["name"], state["token_set"]) == (True, "ada", True)
    # A forged or tampered cookie is no login.
    tampered = client.cookies["ffmem_admin"][:-2] + "xx"
    client.cookies.clear()
    client.cookies.set("ffmem_admin", tampered)
    assert client.post(f"{key}/labels.json", data=LABEL).status_code == 401
    # Logging out clears it.
    client.post("/login", data={"token": TOKEN, "name": "ada"})
    out = client.post("/logout", follow_redirects=False)
    assert out.status_code == 303 and 'ffmem_admin=""' in out.headers["set-cookie"]
    assert client.post(f"{key}/labels.json", data=LABEL).status_code == 401
    assert labels(db) == 1


def test_login_goes_back_only_to_this_site(serve):
    client = serve(host="0.0.0.0", admin_token=TOKEN)
    for target in ("https://evil.example/", "//evil.example/x", "/\\evil.example"):
        answer = client.post("/login", data={"token": TOKEN, "next": target}, follow_redirects=False)
        assert answer.headers["location"] == "/"


def test_read_only_refuses_every_write_and_hides_the_controls(serve, db, slug):
    client = serve(read_only=True, admin_token=TOKEN)
    answer = client.post(
        f"/m/{slug}/layers/1/keys/4/labels.json", data=LABEL, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert answer.json() == {
        "ok": False, "status": 403,
        "error": "This server is read-only: it shows the index but changes nothing.",
    }  # fmt: skip
    assert labels(db) == 0
    home, key = client.get("/").text, client.get(f"/m/{slug}/layers/1/keys/4").text
    analysis = client.get(f"/m/{slug}/analysis").text
    for page in (home, key, analysis):
        assert 'method="post"' not in page and "Log in" not in page and 'class="login"' not in page
    assert client.post("/login", data={"token": TOKEN}).status_code == 403


def test_every_write_route_is_guarded(serve, db, slug):
    """Each POST route but /login and /logout answers 401 without the token, and changes nothing."""
    client = serve(host="0.0.0.0", admin_token=TOKEN)
    posts = [path for path, item in client.get("/openapi.json").json()["paths"].items() if "post" in item]
    values = {"model": slug, "layer": "1", "key": "4", "job_id": "1", "run": "1", "label_id": "1"}
    db.expire_all()
    counts = [db.scalar(select(func.count()).select_from(t)) for t in (Label, Job, Run, MemoryList)]
    reads = [path for path in posts if path.removesuffix(".json") in LIVE_READS]
    assert len(reads) == 4  # each with its .json twin
    guarded = [
        path for path in posts if path not in ("/login", "/login.json", "/logout", "/logout.json", *reads)
    ]
    assert len(guarded) >= 10  # start job, retry, labels, analysis, delete run: each with its .json twin
    for path in guarded:
        answer = client.post(path.format(**values), data={"run": "1", "examples": "5"})
        assert answer.status_code == 401, path
    db.expire_all()
    assert [db.scalar(select(func.count()).select_from(t)) for t in (Label, Job, Run, MemoryList)] == counts


@pytest.mark.parametrize(
    "settings",
    [{"read_only": True}, {"host": "0.0.0.0", "admin_token": TOKEN}, {"host": "0.0.0.0"}],
    ids=["read-only", "token-not-sent", "public-without-token"],
)
def test_a_posted_prompt_is_a_read_answered_as_its_url_is(serve, db, slug, settings):
    """A prompt or text too long for a URL goes as a POST form: a read, answered exactly as the same GET
    (no live worker here: both reach the worker client and get its 503), where writes stay refused."""
    client = serve(worker_url="http://127.0.0.1:9", worker_timeout=2, **settings)
    form = {"text": "The capital of France is"}
    for path in (f"/m/{slug}/trace.json", f"/m/{slug}/layers/1/keys/4.json"):
        posted, got = client.post(path, data=form), client.get(path, params=form)
        assert posted.status_code == got.status_code == 503, path
        assert posted.json() == got.json()
        assert posted.json()["error"].startswith("No live worker answers at http://127.0.0.1:9")
    assert client.post(f"/m/{slug}/layers/1/keys/4/labels.json", data=LABEL).status_code in (401, 403)
    assert labels(db) == 0


def test_an_empty_token_is_no_token(monkeypatch):
    """FFMEM_ADMIN_TOKEN= (docker compose with the variable unset) must not make "" the password."""
    monkeypatch.setenv("FFMEM_ADMIN_TOKEN", "  ")
    assert Settings().admin_token is None
    monkeypatch.setenv("FFMEM_ADMIN_TOKEN", TOKEN)
    assert Settings().admin_token.get_secret_value() == TOKEN


# ---- the write hole: a reverse proxy on the same machine ----------------------------------------

PROXIED = {
    "ok": False,
    "status": 403,
    "error": "This request came through a proxy (it carries X-Forwarded-For) and this server has no admin "
    "token, so it refuses writes: behind a proxy every client looks local. "
    "Set FFMEM_ADMIN_TOKEN and log in at /login.",
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class FakeReverseProxy(ThreadingHTTPServer):
    """A reverse proxy on 127.0.0.1 in front of `upstream`, as nginx would be: it passes each request on
    with the internet client's address in X-Forwarded-For (here always 203.0.113.9)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = httpx.Client(base_url=upstream)
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _ProxyHandler(BaseHTTPRequestHandler):
    def _pass_on(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
        headers |= {"X-Forwarded-For": "203.0.113.9", "X-Forwarded-Proto": "http"}
        answer = self.server.upstream.request(self.command, self.path, content=body, headers=headers)
        self.send_response(answer.status_code)
        for name, value in answer.headers.items():
            if name.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(answer.content)))
        self.end_headers()
        self.wfile.write(answer.content)

    do_GET = do_POST = _pass_on

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def behind_proxy(explorer_db, db):
    """start(**settings) → (the proxy's URL, the app's own URL): the explorer served by uvicorn on
    127.0.0.1 as `ffmem serve` serves it (proxy headers believed from 127.0.0.1, the default
    forwarded_allow_ips), behind a fake reverse proxy on the same machine."""
    db.execute(Label.__table__.delete())
    db.commit()
    started = []

    def start(**settings) -> tuple[str, str]:
        app = create_app(Settings(database_url=explorer_db, **settings))
        port = _free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            proxy_headers=True,
            forwarded_allow_ips="127.0.0.1",
        )
        server = uvicorn.Server(config)
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            threading.Event().wait(0.02)
        upstream = f"http://127.0.0.1:{port}"
        proxy = FakeReverseProxy(upstream)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        started.append((app, server, proxy))
        return proxy.url, upstream

    yield start
    for app, server, proxy in started:
        proxy.shutdown()
        proxy.upstream.close()
        server.should_exit = True
        app.state.engine.dispose()


def test_behind_a_reverse_proxy_on_loopback_no_token_refuses_writes(behind_proxy, db, slug):
    """The hole seen: a label POSTed through a proxy to a server on 127.0.0.1 with no token was stored."""
    proxy, direct = behind_proxy()
    url = f"/m/{slug}/layers/1/keys/4/labels.json"
    answer = httpx.post(proxy + url, data=LABEL)
    assert (answer.status_code, answer.json()) == (403, PROXIED)
    assert labels(db) == 0
    assert httpx.get(f"{proxy}/login.json").json()["reason"] == PROXIED["error"]
    page = httpx.get(f"{proxy}/m/{slug}/layers/1/keys/4").text
    assert 'class="label-form"' not in page and "Log in" not in page
    assert httpx.get(f"{proxy}/m/{slug}/layers/1/keys/4.json").status_code == 200  # browsing stays open
    # The same server, asked directly from its own machine (no proxy headers): it may write.
    assert httpx.post(direct + url, data=LABEL).status_code == 201
    assert labels(db) == 1


def test_behind_a_reverse_proxy_the_token_allows_writes(behind_proxy, db, slug):
    proxy, _ = behind_proxy(admin_token=TOKEN)
    url = f"{proxy}/m/{slug}/layers/1/keys/4/labels.json"
    assert httpx.post(url, data=LABEL).status_code == 401
    assert httpx.post(url, data=LABEL, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 201
    assert labels(db) == 1


@pytest.mark.parametrize(
    "header, value, names",
    [
        ("X-Forwarded-For", "127.0.0.1", "X-Forwarded-For"),  # even a local address: a proxy said it
        ("Forwarded", "for=203.0.113.9;proto=https", "Forwarded"),
        ("X-Real-IP", "203.0.113.9", "X-Real-IP"),
    ],
)
def test_any_proxy_header_refuses_writes_without_a_token(serve, db, slug, header, value, names):
    """Trusted or not (no proxy is trusted here: uvicorn leaves the client as it is), any header a proxy
    adds means the client may be anywhere."""
    client = TestClient(ProxyHeadersMiddleware(serve().app, trusted_hosts=""), client=("127.0.0.1", 40000))
    answer = client.post(f"/m/{slug}/layers/1/keys/4/labels.json", data=LABEL, headers={header: value})
    assert (answer.status_code, answer.json()["error"]) == (
        403,
        PROXIED["error"].replace("X-Forwarded-For", names),
    )
    assert labels(db) == 0


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.53", "::1", "::ffff:127.0.0.1"])
def test_a_direct_loopback_client_without_proxy_headers_may_write(serve, db, slug, address):
    client = TestClient(serve().app, client=(address, 40000))
    assert client.post(f"/m/{slug}/layers/1/keys/4/labels.json", data=LABEL).status_code == 201
    assert labels(db) == 1


def test_a_client_from_elsewhere_may_not_write_without_a_token(serve, db, slug):
    """A server on 127.0.0.1 only hears its machine, unless something passes requests on (a proxy whose
    headers are stripped, a tunnel): the client's address decides."""
    client = TestClient(serve().app, client=("10.0.0.5", 40000))
    answer = client.post(f"/m/{slug}/layers/1/keys/4/labels.json", data=LABEL)
    assert (answer.status_code, answer.json()["error"]) == (
        403,
        "This request comes from 10.0.0.5, not from this machine, and this server has no admin token, so "
        "it refuses writes. Set FFMEM_ADMIN_TOKEN and log in at /login.",
    )
    assert labels(db) == 0
