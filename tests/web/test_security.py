"""Safe on the internet: security headers on every response, request size limits (413, 414) in the one
error shape with nothing stored, and a database that is late at start (retried) or gone while serving
(503 + Retry-After, then back) — the latter through a TCP proxy to the test Postgres that the tests stop
and start."""

from __future__ import annotations

import json
import logging
import socket
import threading
from select import select as readable

import pytest
from browser_fixtures import run_coroutine, serving
from fastapi.testclient import TestClient
from sqlalchemy import func, make_url, select
from sqlalchemy.exc import OperationalError

from ffmem.config import Settings
from ffmem.store.db import DatabaseError, Retry, make_engine, upgrade
from ffmem.store.models import Job, Label
from ffmem.web.main import create_app
from ffmem.web.security import RequestLimits

# Both backends: size limits reach the store's queries.
pytestmark = pytest.mark.backends("sqlite", "postgres")

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; style-src-elem 'self' "
    "'sha256-faU7yAF8NxuMTNEwVmBz+VcYeIoBQ2EMHW3WaVxCvnk=' "
    "'sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU='; "
    "style-src-attr 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; object-src 'none'; "
    "base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "strict-origin-when-cross-origin",
    "x-frame-options": "DENY",
    "cross-origin-opener-policy": "same-origin",
}
TOO_LARGE = "The request body is larger than 65,536 bytes, the most this server accepts."
TOO_LONG = (
    "The query string is longer than 8,192 bytes, the most this server accepts; "
    "shorten it, or send a long prompt or text as a form (POST)."
)
GONE = "The database is not answering; try again in a few seconds."
INTERNAL = "Something went wrong on our side; the error was logged."
FORM = {"content-type": "application/x-www-form-urlencoded"}


@pytest.fixture(scope="module")
def app(explorer_db):
    app = create_app(Settings(database_url=explorer_db))

    def boom():
        raise RuntimeError("a bug")

    def lost():
        raise OperationalError(None, None, Exception("server closed the connection unexpectedly"))

    def bad_query():
        raise OperationalError("SELECT nothing", {}, Exception("no such table: nothing"))

    for path, handler in (("/boom.json", boom), ("/lost.json", lost), ("/bad-query.json", bad_query)):
        app.add_api_route(path, handler)
    yield app
    app.state.engine.dispose()


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def assert_secured(response) -> None:
    for name, value in SECURITY_HEADERS.items():
        assert response.headers.get_list(name) == [value], name


def count(db, table) -> int:
    return db.scalar(select(func.count()).select_from(table))


# Security headers


def test_every_kind_of_response_carries_the_security_headers(client, slug):
    page = client.get(f"/m/{slug}")
    twin = client.get(f"/m/{slug}.json")
    static = client.get("/static/vendor/htmx-2.0.11.min.js")
    missing, missing_json = client.get("/nowhere"), client.get("/nowhere.json")
    jump = client.get(f"/m/{slug}/search", params={"q": "L1 K2"}, follow_redirects=False)
    crash = client.get("/boom.json")  # answered by Starlette's outermost middleware
    assert [r.status_code for r in (page, twin, static, missing, missing_json, jump, crash)] == [
        200, 200, 200, 404, 404, 303, 500,
    ]  # fmt: skip
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert static.headers["content-type"] == "text/javascript; charset=utf-8"
    assert jump.headers["location"] == f"/m/{slug}/layers/1/keys/2"
    assert crash.json() == {"ok": False, "error": INTERNAL, "status": 500}
    for response in (page, twin, static, missing, missing_json, jump, crash):
        assert_secured(response)


# Size limits


def test_a_body_over_the_limit_is_a_413_in_both_shapes(client):
    body = b"model=x&corpus=y&sentences=1&top_k=1&pad=" + b"a" * 65536
    refused = client.post("/jobs.json", content=body, headers=FORM)
    assert refused.status_code == 413
    assert refused.json() == {"ok": False, "error": TOO_LARGE, "status": 413}
    assert_secured(refused)
    page = client.post("/jobs", content=body, headers=FORM)
    assert page.status_code == 413 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "<h1>413 · Request too large</h1>" in page.text and TOO_LARGE in page.text
    assert_secured(page)


def test_a_chunked_body_is_refused_as_it_passes_the_limit(app):
    """Through a real server: a chunked body that never ends is answered 413 once past the limit."""
    head = (
        b"POST /jobs.json HTTP/1.1\r\nHost: test\r\nContent-Type: application/x-www-form-urlencoded\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"%x\r\n%s\r\n" % (1000, b"a" * 1000)
    with serving(app) as port, socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(head)
        sent = 0
        while not readable([sock], [], [], 0.01)[0]:  # until the server answers
            assert sent < 1_000_000, "the server read 1 MB without answering"
            sock.sendall(chunk)
            sent += 1000
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            answer += sock.recv(65536)
    assert 65536 < sent < 65536 + 1000 * 64  # refused soon after the limit (the rest was in flight)
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413 ")
    assert json.loads(body) == {"ok": False, "error": TOO_LARGE, "status": 413}


def test_a_query_over_the_limit_is_a_414_in_both_shapes(client, slug):
    query = "text=" + "a" * (8192 - 5 + 1)  # 8,193 bytes
    refused = client.get(f"/m/{slug}/trace.json?{query}")
    assert refused.status_code == 414
    assert refused.json() == {"ok": False, "error": TOO_LONG, "status": 414}
    page = client.get(f"/m/{slug}/trace?{query}")
    assert page.status_code == 414 and "<h1>414 · Query too long</h1>" in page.text and TOO_LONG in page.text
    assert_secured(page)
    at_limit = client.get(f"/m/{slug}/search.json?{query[:-1]}")  # 8,192 bytes: allowed
    assert at_limit.status_code == 200


def test_a_refused_post_stores_nothing(client, db, slug):
    """The same label and job forms store a row under the limit and nothing over it."""
    label_form = b"pattern=ends+in+Paris&tag=semantic&author=me"
    job_form = b"model=smollm2-135m&corpus=wiki-vital&sentences=5&top_k=3"
    pad = b"&pad=" + b"a" * 65536
    labels, jobs = count(db, Label), count(db, Job)
    for path, form in ((f"/m/{slug}/layers/1/keys/4/labels", label_form), ("/jobs", job_form)):
        for suffix in ("", ".json"):
            assert client.post(f"{path}{suffix}", content=form + pad, headers=FORM).status_code == 413

            def chunks(form=form):  # no Content-Length
                yield form + pad

            assert client.post(f"{path}{suffix}", content=chunks(), headers=FORM).status_code == 413
    assert (count(db, Label), count(db, Job)) == (labels, jobs)
    # The control: the forms themselves are stored (so the refusals above are what stored nothing).
    assert (
        client.post(f"/m/{slug}/layers/1/keys/4/labels.json", content=label_form, headers=FORM).status_code
        == 201
    )
    assert client.post("/jobs.json", content=job_form, headers=FORM).status_code == 201
    assert (count(db, Label), count(db, Job)) == (labels + 1, jobs + 1)


class Recorder:
    """An ASGI app that records the body it read, behind RequestLimits (10 bytes of query and body; 20 of a
    live view's form)."""

    def __init__(self) -> None:
        self.body: bytes | None = None
        self.limits = RequestLimits(self, max_body=10, max_query=10, max_live=20)

    async def __call__(self, scope, receive, send) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        self.body = body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def call(
        self, chunks, *, query: bytes = b"", length: int | None = None, path: str = "/x.json"
    ) -> tuple[int, int]:
        """(status, messages the limits read) for a request whose body arrives as `chunks` (an iterator)."""
        headers = [(b"content-type", b"application/x-www-form-urlencoded")]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
                 "query_string": query, "headers": headers, "server": ("t", 80)}  # fmt: skip
        received, sent = [0], []

        async def receive():
            received[0] += 1
            chunk = next(chunks, None)
            if chunk is None:
                return {"type": "http.request", "body": b"", "more_body": False}
            return {"type": "http.request", "body": chunk, "more_body": True}

        async def send(message):
            sent.append(message)

        run_coroutine(self.limits(scope, receive, send))
        return sent[0]["status"], received[0]


def forever(chunk: bytes):
    while True:
        yield chunk


def test_limits_pass_a_body_at_the_limit_whole_and_stop_reading_past_it():
    app = Recorder()
    assert app.call(iter([b"12345", b"67890"])) == (200, 3)
    assert app.body == b"1234567890"  # the app reads what the limits read, then the rest of the stream
    app.body = None
    assert app.call(forever(b"1234")) == (413, 3)  # 4 + 4 + 4 > 10: refused at the third chunk
    assert app.body is None  # the app never ran
    assert app.call(forever(b"1"), length=11) == (413, 0)  # the declared length is enough: nothing read
    assert app.body is None


@pytest.mark.parametrize(
    ("path", "limit"),
    [
        ("/m/gpt2/trace.json", 20),
        ("/m/gpt2/layers/3/keys/7.json", 20),
        ("/m/gpt2/layers/3/keys/7/labels.json", 10),  # a write: the ordinary limit
        ("/m/gpt2/trace/x.json", 10),
        ("/jobs.json", 10),
    ],
)
def test_a_live_views_form_has_room_for_the_longest_text(path, limit):
    """A prompt or text too long for a URL is POSTed: its form may be as large as `max_live`."""
    app = Recorder()
    assert app.call(iter([b"a" * limit]), path=path)[0] == 200
    assert app.call(iter([b"a" * (limit + 1)]), path=path)[0] == 413


def test_limits_pass_a_query_at_the_limit():
    app = Recorder()
    assert app.call(iter([]), query=b"a=12345678")[0] == 200
    assert app.call(iter([]), query=b"a=123456789")[0] == 414


# The database: late at start, gone while serving


def test_a_lost_connection_is_a_503_and_a_bad_query_still_a_500(client):
    lost = client.get("/lost.json")
    assert (lost.status_code, lost.headers["retry-after"]) == (503, "5")
    assert lost.json() == {"ok": False, "error": GONE, "status": 503}
    bad = client.get("/bad-query.json")
    assert bad.status_code == 500 and bad.json() == {"ok": False, "error": INTERNAL, "status": 500}


class Proxy:
    """A TCP proxy from a free local port to `target`, in threads; `stop` closes the listener and every
    forwarded connection (the database "goes away"), `start` listens on the same port again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.listener: socket.socket | None = None
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen()
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        with self.lock:
            sockets, self.open = [self.listener, *self.open], []
        self.listener = None
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the threads blocked on it
            except OSError:
                pass
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def proxy(postgres_url):
    """A stopped proxy to the test Postgres (migrated), and the test schema's URL through it."""
    upgrade(postgres_url)
    url = make_url(postgres_url)
    proxy = Proxy((url.host, url.port or 5432))
    proxy.url = url.set(port=proxy.port).render_as_string(hide_password=False)
    yield proxy
    if proxy.listener is not None:
        proxy.stop()


@pytest.fixture
def retry_lines():
    """The messages logged on the "ffmem" logger while the test runs; `.then(n, action)` runs `action`
    when the n-th message is logged (from the logging thread, before the retry's wait)."""

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []
            self.actions: dict[int, callable] = {}

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())
            if len(self.messages) in self.actions:
                self.actions[len(self.messages)]()

        def then(self, n: int, action) -> None:
            self.actions[n] = action

    lines = Lines()
    logger = logging.getLogger("ffmem")
    logger.addHandler(lines)
    yield lines
    logger.removeHandler(lines)


def settings_through(proxy, attempts: int) -> Settings:
    return Settings(
        database_url=proxy.url, db_connect_attempts=attempts, db_connect_wait=0.05, db_connect_wait_max=0.2
    )


def test_the_app_waits_for_a_postgres_that_comes_up_late(proxy, retry_lines):
    retry_lines.then(2, proxy.start)  # Postgres answers from the third try on
    app = create_app(settings_through(proxy, attempts=5))
    where = f"Postgres at 127.0.0.1:{proxy.port}/{make_url(proxy.url).database} is not answering"
    assert retry_lines.messages == [
        f"{where} (Connection refused); retrying in 0.05 s (attempt 1 of 5)",
        f"{where} (Connection refused); retrying in 0.1 s (attempt 2 of 5)",
    ]
    with TestClient(app) as client:
        assert client.get("/.json").status_code == 200
    app.state.engine.dispose()


def test_the_app_gives_up_on_a_postgres_that_never_answers(proxy, retry_lines):
    with pytest.raises(DatabaseError) as failed:
        create_app(settings_through(proxy, attempts=3))
    assert len(retry_lines.messages) == 2 and retry_lines.messages[1].endswith("(attempt 2 of 3)")
    message = str(failed.value)
    assert message.startswith(f"cannot open the database at {make_url(proxy.url).render_as_string()}: ")
    assert message.endswith(
        "Connection refused (tried 3 times; FFMEM_DB_CONNECT_ATTEMPTS sets how many). Is the server running "
        "and the URL right? Start it (e.g. `docker compose up -d postgres`), fix FFMEM_DATABASE_URL (--db), "
        "or use a local file: --db sqlite:///data/ffmem.db"
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("not a url", "'not a url' is not a database URL"),
        ("postgresql+nosuchdriver://postgres@127.0.0.1:1/test", "no driver for postgresql+nosuchdriver://"),
        ("postgresql+psycopg://nobody_at_all@{host}:{port}/test", 'role "nobody_at_all" does not exist'),
        ("sqlite:///{tmp}", "unable to open database file"),  # a folder, not a file
    ],
)
def test_what_retrying_cannot_fix_fails_at_once(url, message, postgres_url, tmp_path, retry_lines):
    server = make_url(postgres_url)
    url = url.format(host=server.host, port=server.port or 5432, tmp=tmp_path)
    with pytest.raises(DatabaseError) as failed:
        make_engine(url, Retry(attempts=10, wait=0.05, wait_max=0.2))
    assert message in str(failed.value) and "tried" not in str(failed.value)
    assert retry_lines.messages == []


def test_a_database_gone_while_serving_is_a_503_until_it_is_back(proxy):
    proxy.start()
    app = create_app(settings_through(proxy, attempts=1))
    with TestClient(app) as client:
        assert client.get("/.json").status_code == 200
        proxy.stop()
        gone = client.get("/.json")
        assert (gone.status_code, gone.headers["retry-after"]) == (503, "5")
        assert gone.json() == {"ok": False, "error": GONE, "status": 503}
        page = client.get("/")
        assert page.status_code == 503 and "<h1>503 · Database unavailable</h1>" in page.text
        assert_secured(page)
        proxy.start()
        assert client.get("/.json").status_code == 200
        assert client.get("/").status_code == 200
    app.state.engine.dispose()
