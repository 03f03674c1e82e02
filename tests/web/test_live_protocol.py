"""One live protocol (ffmem/engine/live/protocol.py), through the web app and a real live worker (its ASGI app
in-process, as tests/web/test_live_view.py wires it), on the tiny index: the web sends the worker the
protocol's requests as their JSON, every field of them, and its forms hold a request to the protocol's
limits, so the web and the worker refuse the same over-limit request with the same message."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from ffmem.config import Settings
from ffmem.engine.live.protocol import MAX_ABLATION_PREFIXES
from ffmem.store.models import LanguageModel
from ffmem.web.main import create_app
from ffmem.web.worker_client import LiveWorker
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

PROMPT = "The capital of France is"
pytestmark = pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")


class Wire:
    """The live worker's HTTP client, keeping each POST's path and JSON body as they went on the wire."""

    def __init__(self, client: TestClient) -> None:
        self.client, self.sent = client, []

    def post(self, path: str, **kwargs):
        response = self.client.post(path, **kwargs)
        self.sent.append((path, json.loads(response.request.content)))
        return response

    def get(self, path: str, **kwargs):
        return self.client.get(path, **kwargs)


@pytest.fixture(scope="module")
def worker(tiny, tiny_model_dir):
    live = Live(device="cpu", max_tokens=56, queue=4)
    live.models[str(tiny_model_dir)] = tiny
    return TestClient(create_live_app(live), base_url="http://worker")


@pytest.fixture(scope="module")
def wire(worker):
    return Wire(worker)


@pytest.fixture(scope="module")
def client(explorer_db, wire):
    settings = Settings(database_url=explorer_db, trace_rate_limit="0")
    app = create_app(settings, live=LiveWorker("http://worker", 30, client=wire))
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


@pytest.fixture(scope="module")
def source(db) -> str:
    return db.scalars(select(LanguageModel.source)).one()


def test_the_web_sends_the_protocols_requests_every_field(client, wire, slug, source):
    """Each live request goes as the protocol's request model serialized: every field, defaults included."""
    prompt = {"model": source, "text": PROMPT, "position": 2, "readout": "raw", "interventions": "L2K3*0.5"}
    asked = {"text": PROMPT, "position": 2, "readout": "raw", "intervene": "L2K3*0.5", "target": "#5"}
    assert client.get(f"/m/{slug}/trace.json", params=asked | {"memories": 4}).status_code == 200
    assert wire.sent[-1] == (
        "/trace",
        prompt | {"target": "#5", "memories": 4, "generate": 0, "value_tokens": 0},
    )
    assert client.get(f"/m/{slug}/trace/circuit.json", params=asked | {"nodes": 3}).status_code == 200
    assert wire.sent[-1] == (
        "/circuit",
        prompt | {"target": "#5", "nodes": 3, "top": 5, "threshold": 0.1, "hops": 1},
    )
    assert client.get(f"/m/{slug}/trace.json", params={"text": PROMPT}).status_code == 200
    assert wire.sent[-1] == (
        "/trace",
        {
            "model": source,
            "text": PROMPT,
            "position": None,
            "readout": "norm",
            "interventions": "",
            "target": None,
            "memories": 10,
            "generate": 0,
            "value_tokens": 0,
        },
    )
    assert client.get(f"/m/{slug}/layers/1/keys/4.json", params={"text": "Paris"}).status_code == 200
    assert wire.sent[-1] == ("/coefficients", {"model": source, "text": "Paris", "layer": 1, "key": 4})
    assert client.get(f"/m/{slug}/layers/1/keys/4/ablation.json", params={"triggers": 2}).status_code == 200
    path, body = wire.sent[-1]
    assert (path, set(body)) == ("/ablation", {"model", "layer", "key", "prefixes", "targets"})
    assert (body["model"], body["layer"], body["key"], len(body["prefixes"]), len(body["targets"])) == (
        source,
        1,
        4,
        2,
        2,
    )


# (web route, its query, the worker's path, its body's fields, the web's field name → the worker's)
OVER_LIMIT = [
    ("trace", {"memories": 101}, "/trace", {"memories": 101}),
    ("trace", {"memories": 0}, "/trace", {"memories": 0}),
    ("trace", {"generate": 21}, "/trace", {"generate": 21}),
    ("trace", {"intervene": "x" * 4001}, "/trace", {"interventions": "x" * 4001}),
    ("trace", {"target": "a" * 10_001}, "/trace", {"target": "a" * 10_001}),
    ("trace/circuit", {"nodes": 51}, "/circuit", {"nodes": 51}),
    ("trace/circuit", {"top": 21}, "/circuit", {"top": 21}),
    ("trace/circuit", {"threshold": 1.5}, "/circuit", {"threshold": 1.5}),
    ("trace/circuit", {"hops": 3}, "/circuit", {"hops": 3}),
    ("trace/circuit", {"intervene": "x" * 4001}, "/circuit", {"interventions": "x" * 4001}),
]
REFUSALS = [
    "memories: Input should be less than or equal to 100",
    "memories: Input should be greater than or equal to 1",
    "generate: Input should be less than or equal to 20",
    "{field}: String should have at most 4000 characters",
    "target: String should have at most 10000 characters",
    "nodes: Input should be less than or equal to 50",
    "top: Input should be less than or equal to 20",
    "threshold: Input should be less than or equal to 1",
    "hops: Input should be less than or equal to 2",
    "{field}: String should have at most 4000 characters",
]


@pytest.mark.parametrize(
    ("route", "query", "path", "fields", "refusal"),
    [(*case, refusal) for case, refusal in zip(OVER_LIMIT, REFUSALS, strict=True)],
    ids=[f"{case[0]} {next(iter(case[1]))}" for case in OVER_LIMIT],
)
def test_the_web_and_the_worker_refuse_an_over_limit_request_alike(
    client, worker, slug, source, route, query, path, fields, refusal
):
    asked = {"text": PROMPT} | query
    web = (  # the live view's form (a target past the query's limit), the circuit's query
        client.post(f"/m/{slug}/trace.json", data=asked)
        if route == "trace"
        else client.get(f"/m/{slug}/{route}.json", params=asked)
    )
    direct = worker.post(path, json={"model": source, "text": PROMPT} | fields)
    assert (web.status_code, direct.status_code) == (400, 400)
    assert web.json()["error"] == refusal.format(field=next(iter(query)))
    assert direct.json() == {"ok": False, "error": refusal.format(field=next(iter(fields))), "status": 400}


def test_the_ablations_triggers_are_held_to_the_workers_limit(client, worker, slug, source):
    """The ablation page asks at most as many prefixes as the worker takes: the one limit, both sides."""
    web = client.get(
        f"/m/{slug}/layers/1/keys/4/ablation.json", params={"triggers": MAX_ABLATION_PREFIXES + 1}
    )
    assert (web.status_code, web.json()["error"]) == (
        400,
        "triggers: Input should be less than or equal to 100",
    )
    rows = [[5]] * (MAX_ABLATION_PREFIXES + 1)
    direct = worker.post(
        "/ablation", json={"model": source, "layer": 1, "key": 4, "prefixes": rows, "targets": rows}
    )
    assert direct.status_code == 400
    assert direct.json()["error"] == (
        "prefixes: List should have at most 100 items after validation, not 101; "
        "targets: List should have at most 100 items after validation, not 101"
    )
    ablation = client.get("/openapi.json").json()["paths"]["/m/{model}/layers/{layer}/keys/{key}/ablation"]
    web_limit = next(p["schema"]["maximum"] for p in ablation["get"]["parameters"] if p["name"] == "triggers")
    worker_schema = worker.get("/openapi.json").json()["components"]["schemas"]["AblationRequest"]
    assert web_limit == worker_schema["properties"]["prefixes"]["maxItems"] == MAX_ABLATION_PREFIXES
