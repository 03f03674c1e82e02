"""Schemathesis over the app's own OpenAPI document (/openapi.json), on the tiny index with a real
live worker in-process, SQLite and Postgres: every operation of the document (a new route is fuzzed
without touching this file), positive and negative cases, with the index's model named in the path
half the time so the cases reach past the 404. Checks: no server error (5xx), the status code, the
content type and the body of the answer documented for the operation. The reads go first, the writes
(which may queue jobs or delete the run) last.

FFMEM_FUZZ_EXAMPLES sets the cases per operation (default 20: the CI size); bench/fuzz.py runs the
same test ten times larger and records what it sent in bench-results.json. The cases are derandomized
and do not depend on the backend (the same document, the same model slug): Hypothesis draws them on the
first backend, and the second is sent the very same cases, which saves drawing them again (three fifths
of an operation's time). Below: a regression test for each failure the fuzzing found, and the
document's promises.
"""

from __future__ import annotations

import os
import re

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy import select

from ffmem.config import Settings
from ffmem.store.models import Job
from ffmem.web.main import create_app
from ffmem.web.worker_client import LiveWorker
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

EXAMPLES = int(os.environ.get("FFMEM_FUZZ_EXAMPLES", "20"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
pytestmark = [
    pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument"),
    pytest.mark.backends("sqlite", "postgres"),  # a bad value can fail in one backend's driver alone
]


def _document() -> dict:
    app = create_app(Settings(database_url="sqlite://"))
    document = app.openapi()
    app.state.engine.dispose()
    return document


DOCUMENT = _document()
OPERATIONS = sorted(
    ((method.upper(), path) for path, item in DOCUMENT["paths"].items() for method in item),
    key=lambda operation: operation[0] != "GET",  # stable: the document's order within each group
)


def live_app(database_url: str, tiny, tiny_model_dir):
    """The app over `database_url`, its live worker in-process with the tiny model; no rate limit, so
    every live case reaches the worker."""
    live = Live(device="cpu", max_tokens=56, queue=4)
    live.models[str(tiny_model_dir)] = tiny
    worker = TestClient(create_live_app(live), base_url="http://worker")
    settings = Settings(database_url=database_url, trace_rate_limit="0")
    return create_app(settings, live=LiveWorker("http://worker", 30, client=worker))


@pytest.fixture(scope="module")
def app(explorer_db, tiny, tiny_model_dir):
    app = live_app(explorer_db, tiny, tiny_model_dir)
    yield app
    app.state.engine.dispose()


@pytest.fixture(scope="module")
def schema(app):
    return schemathesis.openapi.from_asgi("/openapi.json", app)


# (method, path, model slug) → the cases an operation was sent, once it passed on one backend
DRAWN: dict[tuple[str, str, str], list[schemathesis.Case]] = {}


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_operation(app, schema, slug, method, path, record_property):
    if (method, path, slug) in DRAWN:  # drawn on the other backend: the same cases, sent to this one's app
        cases = DRAWN[method, path, slug]
        for case in cases:
            case.call_and_validate(checks=CHECKS, app=app)
        record_property("cases", len(cases))
        return
    operation = schema[path][method]
    named = {"model": slug} if "{model}" in path else {}
    cases = st.one_of(
        [operation.as_strategy(mode, path_parameters=fixed) for mode in MODES for fixed in ({}, named)]
    )
    sent = []

    @given(case=cases)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
    )
    def fuzz(case):
        sent.append(case)
        case.call_and_validate(checks=CHECKS)

    try:
        fuzz()
    finally:
        record_property("cases", len(sent))
    DRAWN[method, path, slug] = sent


# ---- what the fuzzing found ---------------------------------------------------------------------

MOMENT = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")  # RFC 3339, UTC


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as client:
        yield client


def test_times_carry_their_offset_on_both_backends(client, db):
    """SQLite gives back naive datetimes: the JSON said "2026-…T01:51:14" there (no date-time of RFC
    3339, and not what Postgres said) until the contexts marked them UTC."""
    job = db.scalars(select(Job.id).order_by(Job.id)).first()
    body = client.get(f"/jobs/{job}.json").json()
    moments = [body["job"][name] for name in ("created_at", "started_at", "finished_at")]
    moments += [body["run"]["started_at"], body["run"]["finished_at"]]
    assert all(MOMENT.match(moment) for moment in moments), moments
    home = client.get("/.json").json()
    assert all(MOMENT.match(run["started_at"]) for entry in home["models"] for run in entry["runs"])
    assert 'datetime="' in client.get("/").text and "+00:00" in client.get("/").text


@pytest.mark.parametrize(
    ("method", "url"), [("GET", "/jobs/{}.json"), ("POST", "/jobs/{}/retry.json"), ("GET", "/jobs/{}")]
)
def test_a_job_number_past_32_bits_is_a_400_not_an_overflow(client, method, url):
    """A job id past the database's integers overflowed in the query (a 500 on both backends)."""
    for number in (2**31, 10**30):
        response = client.request(method, url.format(number))
        assert response.status_code == 400
        if url.endswith(".json"):
            assert response.json() == {
                "ok": False,
                "error": "job_id: Input should be less than or equal to 2147483647",
                "status": 400,
            }
    largest = client.request(method, url.format(2**31 - 1))
    assert largest.status_code == 404


# ---- the document -------------------------------------------------------------------------------

ERROR_BODY = {
    "additionalProperties": False,
    "description": "The one error shape of `.json` paths (ffmem/web/errors.py).",
    "properties": {
        "ok": {"const": False, "description": "Always false on an error.", "title": "Ok", "type": "boolean"},
        "error": {
            "description": "What went wrong and what to do about it.",
            "title": "Error",
            "type": "string",
        },
        "status": {"description": "The HTTP status of the answer.", "title": "Status", "type": "integer"},
        "link": {
            "description": "Where to go next, given when there is a page for it (a job's, say).",
            "title": "Link",
            "type": "string",
        },
    },
    "required": ["ok", "error", "status"],
    "title": "ErrorBody",
    "type": "object",
}


def test_every_operation_documents_its_errors_in_the_one_shape():
    assert DOCUMENT["components"]["schemas"]["ErrorBody"] == ERROR_BODY
    # the live routes; the key page asks the live worker for `?text=` (try your own text)
    live = (
        "/m/{model}/trace",
        "/m/{model}/layers/{layer}/keys/{key}/ablation",
        "/m/{model}/layers/{layer}/keys/{key}",
    )
    for path, item in DOCUMENT["paths"].items():
        for method, operation in item.items():
            codes = {code for code in operation["responses"] if code != "422"}
            expected = {"400", "404", "413", "414", "503"}
            if path.removesuffix(".json") in live:
                expected |= {"429", "502", "504"}
            assert expected <= codes, (method, path)
            for code in codes - {"200", "201", "303"}:
                content = operation["responses"][code]["content"]
                if path.endswith(".json"):
                    assert content == {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}
                    }
                else:
                    assert content == {"text/html": {"schema": {"type": "string"}}}
    writes = [
        item["post"]
        for path, item in DOCUMENT["paths"].items()
        if "post" in item
        and not path.startswith(("/login", "/logout"))  # logging in is no write
        and path.removesuffix(".json") not in live[:1] + live[2:]  # a long prompt or text as a form: a read
    ]
    assert len(writes) >= 6 and all({"401", "403"} <= set(operation["responses"]) for operation in writes)
    key = DOCUMENT["paths"]["/m/{model}/layers/{layer}/keys/{key}.json"]["get"]["responses"]["200"]
    assert key["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/KeyContext"}


def test_the_document_does_not_advertise_fastapis_422():
    """The app answers malformed input with a 400 (ffmem/web/errors.py), never FastAPI's 422."""
    app = create_app(Settings(database_url="sqlite://"))
    with TestClient(app) as client:
        document = client.get("/openapi.json").json()  # the document served
    app.state.engine.dispose()
    responses = [op["responses"] for item in document["paths"].values() for op in item.values()]
    assert responses and not [r for r in responses if "422" in r]
    assert "HTTPValidationError" not in document["components"]["schemas"]
