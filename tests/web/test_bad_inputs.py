"""Every route of the app (enumerated from the app itself: a new route is covered without touching this
file), on the tiny index, SQLite and Postgres, sent the classic bad inputs one at a time, in each path
parameter, query parameter and form field, the others valid.

Each answer is a 4xx in the one error shape (`.json`: exactly {"ok": false, "error", "status"}, the
status the HTTP one; HTML otherwise) or a 200; markup never comes back unescaped, a template
expression never rendered; where the value is shown back, it is shown escaped; and nothing stored
changes (every table's rows, hashed, before and after). POSTs carry one bad field each, so each must be
refused; the free-text fields (a label's pattern, a job's model) are tested with the same payloads
stored: they come back escaped on every page that shows them.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from urllib.parse import quote, unquote

import pytest
from fastapi.routing import APIRoute, iter_route_contexts
from fastapi.testclient import TestClient
from markupsafe import escape
from pydantic import BaseModel
from sqlalchemy import func, inspect, select

from ffmem.config import Settings
from ffmem.store.models import Job, Run
from ffmem.web.main import create_app
from ffmem.web.worker_client import LiveWorker
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

# name → the value as it goes on the wire (already percent-encoded)
BAD = {
    "huge": str(10**30),
    "2**63": str(2**63),
    "negative": "-1",
    "fraction": "1.5",
    "exponent": "1e3",
    "word": "abc",
    "invalid utf-8": "%ff%fe",
    "bad escape": "%zz",
    "lone percent": "%",
    "nul": "%00",
    "sql": quote("' OR 1=1 --", safe=""),
    "template": quote("{{7*7}}", safe=""),
    "raw template": quote("{% raw %}{{7*7}}{% endraw %}", safe=""),
    "script": quote("<script>alert(1)</script>", safe=""),
    "attribute": quote('"><img src=x onerror=alert(1)>', safe=""),
    "javascript url": quote("javascript:alert(1)", safe=""),
}
MEGABYTE = "a" * 1_000_000
ECHO = "zq7echo"  # a harmless marker: where it is shown back, a payload must be shown back escaped
PRINTABLE = {"sql", "template", "raw template", "script", "attribute", "javascript url"}
ERROR_KEYS = {"ok", "error", "status"}  # and, where there is a page to go to next, "link" (routes.ErrorBody)
RAW_MARKUP = ("<script>alert(1)</script>", "<img src=x onerror", 'href="javascript:', 'src="javascript:')


def _routes() -> list[tuple[str, str, object]]:
    """(method, path, route) of every route the app serves, static files aside."""
    app = create_app(Settings(database_url="sqlite://"))
    found = []
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                found.append((method, context.path_format, route))
    app.state.engine.dispose()
    return found


ROUTES = _routes()
pytestmark = [
    pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument"),
    pytest.mark.backends("sqlite", "postgres"),  # a bad value can fail in one backend's driver alone
]


@pytest.fixture(scope="module")
def app(explorer_db, tiny, tiny_model_dir):
    live = Live(device="cpu", max_tokens=56, queue=4)
    live.models[str(tiny_model_dir)] = tiny
    worker = TestClient(create_live_app(live), base_url="http://worker")
    settings = Settings(database_url=explorer_db, trace_rate_limit="0")
    app = create_app(settings, live=LiveWorker("http://worker", 30, client=worker))
    yield app
    app.state.engine.dispose()


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as client:
        yield client


@pytest.fixture(scope="module")
def valid(db, slug) -> dict[str, str]:
    """A valid value of every path parameter and form field (a new one fails the test until it has one)."""
    return {
        "model": slug,
        "layer": "1",
        "key": "4",
        "job_id": str(db.scalars(select(Job.id).order_by(Job.id)).first()),
        "run": str(db.scalars(select(Run.id)).one()),
        # POST /jobs
        "corpus": "wiki-vital",
        "sentences": "40",
        "top_k": "5",
        "analyze": "false",
        "first_position": "false",
        # a label, and deleting one
        "pattern": "capital cities",
        "label_id": "1",
        # a gated key's sign quadrant
        "quadrant": "nn",
        # a corpus upload (sent as a form field, not a file: refused however it is filled)
        "file": "corpus.txt",
        "tag": "semantic",
        "author": "tester",
        # comparing two runs (a run with itself: refused)
        "a": str(db.scalars(select(Run.id)).one()),
        "b": str(db.scalars(select(Run.id)).one()),
        # an analysis
        "examples": "10",
        "keys": "5",
        "triggers": "3",
        # a live view or a key page's text sent as a form (POST)
        "text": "The capital of France is",
        "position": "0",
        "intervene": "L1K4",
        "readout": "norm",
        "memories": "5",
        "generate": "0",
        "target": "#7",
        "heatmap": "active",
        # logging in
        "token": "not-the-token",
        "name": "tester",
        "next": "/",
    }


@dataclass
class Answer:
    status_code: int
    headers: dict[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self):
        return json.loads(self.content)


async def _asgi(app, scope: dict, body: bytes) -> Answer:
    """One request to the ASGI app, exactly as given (no client normalizes the URL or limits its size)."""
    parts, answer = [{"type": "http.request", "body": body, "more_body": False}], {}

    async def receive():
        return parts.pop(0) if parts else {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
            answer["headers"] = {k.decode().lower(): v.decode() for k, v in message["headers"]}
            answer["body"] = b""
        elif message["type"] == "http.response.body":
            answer["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return Answer(answer["status"], answer["headers"], answer["body"])


def request(client, method: str, raw_path: str, query: str = "", body: bytes = b"", form: bool = False):
    headers = [(b"host", b"testserver")]
    if form:
        headers += [(b"content-type", b"application/x-www-form-urlencoded")]
        headers += [(b"content-length", str(len(body)).encode())]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": unquote(raw_path),
        "raw_path": raw_path.encode("latin-1"),
        "query_string": query.encode("latin-1"),
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
        "state": {},
    }
    return client.portal.call(_asgi, client.app, scope, body)


def snapshot(app) -> dict[str, tuple[int, str]]:
    """Every table's row count and a hash of its rows (sorted: the order rows come back in is free). The
    tables are listed afresh each time, their rows read with `SELECT *`: reflecting their columns (what
    MetaData.reflect does) took three quarters of a snapshot's time and adds nothing to the comparison."""
    with app.state.engine.connect() as connection:
        quote = connection.dialect.identifier_preparer.quote
        found = {}
        for name in sorted(inspect(connection).get_table_names()):
            table = connection.exec_driver_sql(f"SELECT * FROM {quote(name)}")
            rows = sorted(repr(tuple(row)) for row in table)
            found[name] = (len(rows), hashlib.sha256("\n".join(rows).encode()).hexdigest())
    return found


def _typed_fields(route, where: str) -> dict[str, object]:
    """The route's query parameters or form fields, each with its type; a parameter model (the live
    view's TraceForm) stands for its fields."""
    if not isinstance(route, APIRoute):
        return {}
    params, dependants = [], [route.dependant]  # the route's own and its lookups' (ffmem/web/deps.py)
    while dependants:
        dependant = dependants.pop(0)
        params += {"query": dependant.query_params, "form": dependant.body_params}[where]
        dependants += dependant.dependencies
    found = {}
    for param in params:
        kind = param.field_info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            found |= {field.alias or name: field.annotation for name, field in kind.model_fields.items()}
        else:
            found[param.alias] = kind
    return found


def _fields(route, where: str) -> list[str]:
    return list(_typed_fields(route, where))


def _free_text(route, name: str) -> bool:
    """Whether form field `name` takes any text (so a payload in it is a valid request)."""
    return _typed_fields(route, "form")[name] in (str, str | None)


def cases(method: str, path: str, route, valid: dict) -> list[tuple[str, str, str, str]]:
    """(where, name, bad value's name, wire value) for one route: each bad value in each path parameter
    and query parameter; in each form field where it makes the request invalid; and a megabyte of
    query string everywhere."""
    found = [("query", "q", "megabyte", MEGABYTE)]
    for name in re.findall(r"{(\w+)}", path):
        found += [("path", name, what, value) for what, value in BAD.items()]
    for name in _fields(route, "query"):
        found += [("query", name, what, value) for what, value in BAD.items()]
    for name in _fields(route, "form"):
        if _free_text(route, name):  # any text is valid here: only a megabyte of it is refused
            found.append(("form", name, "megabyte", MEGABYTE))
        else:
            found += [("form", name, what, value) for what, value in BAD.items()]
    return found


def send(client, method: str, path: str, route, valid: dict, where: str, name: str, value: str):
    """The request with `value` (as on the wire) in parameter `name`, everything else valid."""
    missing = [
        field for field in [*re.findall(r"{(\w+)}", path), *_fields(route, "form")] if field not in valid
    ]
    if missing:
        pytest.fail(f"{method} {path}: no valid value for {missing}: add one to the `valid` fixture")
    filled = re.sub(r"{(\w+)}", lambda m: value if (where, m[1]) == ("path", name) else valid[m[1]], path)
    query = f"{name}={value}" if where == "query" else ""
    if method == "GET":
        return request(client, method, filled, query)
    form = {field: quote(valid[field], safe="") for field in _fields(route, "form")}
    if where == "form":
        form[name] = value
    body = "&".join(f"{field}={wired}" for field, wired in form.items()).encode("latin-1")
    return request(client, method, filled, query, body, form=True)


def problems_with(response, path: str, method: str, what: str, value: str, echoed: bool) -> list[str]:
    """What is wrong with one answer (nothing: a refusal in the error shape, or a 200 that shows the
    value only escaped)."""
    status, kind = response.status_code, response.headers.get("content-type", "")
    is_json = path.endswith(".json") or path == "/openapi.json"
    found = []
    if not (status == 200 and method == "GET" or 400 <= status < 500):
        found.append(f"answered {status}")
    if not kind.startswith("application/json" if is_json else "text/html"):
        found.append(f"content-type {kind!r}")
        return found
    if is_json:
        body = response.json()
        shape = ERROR_KEYS <= set(body) <= ERROR_KEYS | {"link"}
        if status >= 400 and (not shape or body["ok"] is not False or body["status"] != status):
            found.append(f"error body {body}")
        if status >= 400 and not (isinstance(body.get("error"), str) and body["error"]):
            found.append(f"no error message in {body}")
        return found
    page = response.text
    found += [f"unescaped {raw!r}" for raw in RAW_MARKUP if raw in page]
    if echoed and what in PRINTABLE:  # the marker came back: the value must, escaped
        shown = str(escape(unquote(value)))
        if shown not in page:
            found.append(f"{shown!r} not shown back though {ECHO!r} is")
    return found


@pytest.mark.parametrize(("method", "path", "route"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_bad_inputs_are_refused_or_shown_escaped(app, client, valid, method, path, route):
    before = snapshot(app)
    problems, markers = [], {}
    for where, name, what, value in cases(method, path, route, valid):
        if method == "GET" and (where, name) not in markers:  # a POST with the marker would be valid
            markers[where, name] = send(client, method, path, route, valid, where, name, ECHO)
        response = send(client, method, path, route, valid, where, name, value)
        # Where the marker is shown back (links aside: they carry the query percent-encoded), a value
        # answered the same way must be shown back escaped. A "/" in a path value ends the parameter.
        marker = markers.get((where, name))
        echoed = (
            marker is not None
            and marker.status_code == response.status_code
            and ECHO in re.sub(r'href="[^"]*"', "", marker.text)
            and not (where == "path" and "/" in unquote(value))
        )
        problems += [
            f"{what} in {where} {name}: {problem}"
            for problem in problems_with(response, path, method, what, value, echoed)
        ]
    assert problems == []
    assert snapshot(app) == before


# ---- payloads in free-text fields are stored and shown back escaped ------------------------------

PAYLOADS = [unquote(BAD[what]) for what in sorted(PRINTABLE)] + ["nul \x00 inside", "bad \ufffd\ufffd"]


def test_payloads_in_free_text_are_stored_as_given_and_shown_escaped(app, client, slug):
    """A label's pattern and author, a job's model: any text is valid there, so each payload is a valid
    request that adds exactly one row, and every page that shows it shows it escaped."""
    before = snapshot(app)
    for n, payload in enumerate(PAYLOADS):
        label = client.post(
            f"/m/{slug}/layers/2/keys/{n}/labels.json", data={"pattern": payload, "author": payload}
        )
        assert label.status_code == 201, label.text
        stored = payload.replace("\x00", "\u2400")  # a NUL is stored as the symbol that shows it
        assert (label.json()["label"]["pattern"], label.json()["label"]["author"]) == (stored, stored)
        job = client.post(
            "/jobs.json", data={"model": payload, "corpus": "wiki-vital", "sentences": "7", "top_k": "3"}
        )
        assert job.status_code == 201, job.text
        assert job.json()["job"]["options"]["model"] == payload.strip()
        pages = [
            f"/m/{slug}/layers/2/keys/{n}",
            f"/m/{slug}/layers/2?per_page=100",
            f"/m/{slug}/search?q={quote(payload.strip())}",
            f"/jobs/{job.json()['job']['id']}",
            "/",
        ]
        for url in pages:
            page = client.get(url).text
            assert not [raw for raw in RAW_MARKUP if raw in page], url
            if payload in PAYLOADS[: len(PRINTABLE)]:
                assert str(escape(payload.strip())) in page, url
    after = snapshot(app)
    changed = {table for table in after if after[table] != before[table]}
    assert changed == {"labels", "jobs"}
    assert after["labels"][0] - before["labels"][0] == len(PAYLOADS)
    assert after["jobs"][0] - before["jobs"][0] == len(PAYLOADS)


# ---- a job's corpus ------------------------------------------------------------------------------

USE = "pass wiki-vital, a UTF-8 .txt file or a .jsonl file"


def start(client, corpus: str):
    form = {"model": "smollm2-135m", "corpus": corpus, "sentences": "40", "top_k": "5"}
    return client.post("/jobs.json", data=form)


def test_a_corpus_the_server_sees_is_checked_before_queueing(app, client, tmp_path):
    binary = tmp_path / "corpus.txt.gz"
    binary.write_bytes(bytes.fromhex("1f8b08000000000000ff03000000000000000000"))  # gzip of nothing
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    refused = {
        str(tmp_path): f"The corpus {tmp_path} is a folder, not a file; {USE}.",
        str(binary): f"The corpus {binary} is not UTF-8 text: 100% of its first 20 bytes are control "
        f"characters or not UTF-8 (a binary file?); {USE}.",
        str(empty): f"The corpus {empty} is empty; {USE}.",
        "   ": "corpus: must not be blank",
    }
    before = snapshot(app)
    for corpus, message in refused.items():
        response = start(client, corpus)
        assert (response.status_code, response.json()) == (
            400,
            {"ok": False, "error": message, "status": 400},
        )
        page = client.post("/jobs", data={"model": "m", "corpus": corpus, "sentences": "4", "top_k": "2"})
        assert page.status_code == 400 and "text/html" in page.headers["content-type"]
    assert snapshot(app) == before


def test_a_corpus_path_that_does_not_exist_is_refused_at_once(app, client, tmp_path):
    """Issue 13: a missing corpus path was queued and failed later in the worker; now a 400, and no job."""
    missing = tmp_path / "no-such-corpus.txt"
    before = snapshot(app)
    response = start(client, str(missing))
    assert response.status_code == 400
    assert response.json() == {
        "ok": False,
        "error": f"No corpus file at {missing}; pass wiki-vital, a UTF-8 .txt file or a .jsonl file.",
        "status": 400,
    }
    page = client.post("/jobs", data={"model": "m", "corpus": str(missing), "sentences": "4", "top_k": "2"})
    assert page.status_code == 400 and f"No corpus file at {missing}" in page.text
    with app.state.sessions() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == before["jobs"][0]
    assert snapshot(app) == before


def test_a_corpus_gone_before_the_worker_reads_it_fails_its_job_readably(app, client, tiny, tmp_path):
    """The server checks the path when the job is queued; a worker that cannot read it later (the file
    removed, or not on the worker's machine) fails the job with the reason, shown on the job's page."""
    from ffmem.engine.mining.corpus import CorpusError
    from ffmem.worker.index import IndexOptions
    from ffmem.worker.loop import Worker

    missing = tmp_path / "removed.txt"
    missing.write_text("A sentence that will be gone.\n")
    queued = start(client, str(missing))
    assert queued.status_code == 201
    missing.unlink()
    job = queued.json()["job"]["id"]
    settings = Settings(device="cpu", dtype="float32", cache_dir=tmp_path)
    options = IndexOptions.from_settings(settings, progress=False)
    with pytest.raises(CorpusError):
        Worker(app.state.sessions, options, loaded=tiny).step(job)
    failed = client.get(f"/jobs/{job}.json").json()["job"]
    message = f"no corpus file at {missing}; {USE}"
    assert failed["status"] == "failed"
    assert (failed["error"]["type"], failed["error"]["message"]) == ("CorpusError", message)
    assert f"CorpusError: {message}" in client.get(f"/jobs/{job}").text
