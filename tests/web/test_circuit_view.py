"""The live view's memory circuit through the web app and a real live worker (its ASGI app in-process, as
tests/web/test_live_view.py wires it), on the tiny index: the JSON twin's exact fields and the engine's
numbers, the memories' own top tokens from the index, the one error shape for bad parameters, the page's
node links and escaping, and the live view's link to it."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from markupsafe import escape

from ffmem.config import Settings
from ffmem.engine.live.circuit import circuit
from ffmem.engine.live.interventions import Intervention
from ffmem.engine.live.protocol import (
    CircuitAnswer,
    CircuitEdgeAnswer,
    CircuitNodeAnswer,
    CircuitOptions,
    MemoryRefAnswer,
)
from ffmem.store import memory_reads
from ffmem.web.main import create_app
from ffmem.web.pages.circuit import CIRCUIT_EDGES, CircuitContext, CircuitMemory, circuit_graph
from ffmem.web.worker_client import LiveWorker
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

PROMPT = "The capital of France is"
pytestmark = pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")
CIRCUIT_FIELDS = {
    "page", "title", "model", "text", "position", "readout", "target", "interventions", "options",
    "max_tokens", "notice", "notice_field", "run", "tokens", "attributed", "logit", "nodes", "edges",
    "largest_terms", "trace_url", "link",
}  # fmt: skip
NODE_FIELDS = {"layer", "key", "coefficient", "contribution", "hop", "upstream_sum", "top_token", "url"}
EDGE_FIELDS = {"upstream", "downstream", "term", "coefficient"}


@pytest.fixture(scope="module")
def worker(tiny, tiny_model_dir):
    live = Live(device="cpu", max_tokens=56, queue=4)
    live.models[str(tiny_model_dir)] = tiny
    return TestClient(create_live_app(live), base_url="http://worker")


@pytest.fixture(scope="module")
def client(explorer_db, worker):
    settings = Settings(database_url=explorer_db, trace_rate_limit="0")
    app = create_app(settings, live=LiveWorker("http://worker", 30, client=worker))
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


def test_the_worker_answers_the_circuit_contract(worker, tiny_model_dir):
    request = {"model": str(tiny_model_dir), "text": PROMPT, "position": 3, "nodes": 3, "hops": 2}
    body = worker.post("/circuit", json=request).json()
    assert set(body) == set(CircuitAnswer.model_fields)
    assert set(body["nodes"][0]) == set(CircuitNodeAnswer.model_fields)
    assert set(body["edges"][0]) == set(CircuitEdgeAnswer.model_fields) == EDGE_FIELDS
    assert (body["position"], body["hops"], len(body["largest_terms"])) == (3, 2, 2)
    assert CircuitAnswer.model_validate(body).model_dump(mode="json") == body
    bad = worker.post("/circuit", json=request | {"threshold": 1.5})
    assert bad.status_code == 400 and bad.json()["ok"] is False


def test_circuit_json_twin_equals_the_engine_named_with_the_index(client, db, slug, tiny):
    params = {"text": PROMPT, "position": 3, "target": "#7", "top": 3, "threshold": 0.05, "hops": 2}
    body = client.get(f"/m/{slug}/trace/circuit.json", params=params).json()
    assert set(body) == CIRCUIT_FIELDS
    ids = tiny.tokenizer(PROMPT).input_ids
    expected = circuit(tiny, ids, 3, target=7, top=3, threshold=0.05, hops=2)
    assert body["options"] == {"nodes": 10, "top": 3, "threshold": 0.05, "hops": 2}
    assert (body["position"], body["target"], body["attributed"]["token_id"]) == (3, "#7", 7)
    assert body["logit"] == pytest.approx(expected.logit, abs=1e-5)
    assert body["largest_terms"] == pytest.approx(expected.largest_terms, abs=1e-5)
    assert [t["token_id"] for t in body["tokens"]] == ids
    assert body["tokens"][1]["url"] == (
        f"/m/{slug}/trace/circuit?text=The+capital+of+France+is&position=1&target=%237&top=3&threshold=0.05&hops=2"
    )
    assert body["link"] == (
        f"/m/{slug}/trace/circuit?text=The+capital+of+France+is&position=3&target=%237&top=3&threshold=0.05&hops=2"
    )
    assert body["trace_url"] == f"/m/{slug}/trace?text=The+capital+of+France+is&position=3&target=%237"
    assert len(body["nodes"]) == len(expected.nodes) and {n["hop"] for n in body["nodes"]} >= {0, 1}
    for node, want in zip(body["nodes"], expected.nodes, strict=True):
        assert set(node) == NODE_FIELDS
        assert (node["layer"], node["key"], node["hop"]) == (want.layer, want.key, want.hop)
        assert node["coefficient"] == pytest.approx(want.coefficient, abs=1e-5)
        assert node["contribution"] == pytest.approx(want.contribution, abs=1e-5)
        assert (node["upstream_sum"] is None) == (want.upstream_sum is None)
        assert node["url"] == f"/m/{slug}/layers/{want.layer}/keys/{want.key}"
        direction = 1 if want.coefficient >= 0 else -1
        top = memory_reads.get_value_tokens(
            session=db,
            run_id=body["run"],
            layer=want.layer,
            key=want.key,
            readout="norm",
            direction=direction,
        )[0].token_id
        assert node["top_token"]["token_id"] == top
    assert len(body["edges"]) == len(expected.edges) > 0
    for edge, want in zip(body["edges"], expected.edges, strict=True):
        assert set(edge) == EDGE_FIELDS
        assert edge["upstream"] == {"layer": want.upstream.layer, "key": want.upstream.key}
        assert edge["downstream"] == {"layer": want.downstream.layer, "key": want.downstream.key}
        assert edge["term"] == pytest.approx(want.term, abs=1e-5)
        assert edge["coefficient"] == pytest.approx(want.coefficient, abs=1e-5)


def test_the_circuit_reads_the_edited_pass(client, slug, tiny):
    body = client.get(f"/m/{slug}/trace/circuit.json", params={"text": PROMPT, "intervene": "L0K3*2"}).json()
    assert body["interventions"] == "L0K3*2"
    ids = tiny.tokenizer(PROMPT).input_ids
    expected = circuit(tiny, ids, interventions=[Intervention(0, 3, "scale", 2.0)])
    assert [(n["layer"], n["key"]) for n in body["nodes"]] == [(n.layer, n.key) for n in expected.nodes]
    assert [n["coefficient"] for n in body["nodes"]] == pytest.approx([n.coefficient for n in expected.nodes])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"threshold": 1.5}, "threshold: Input should be less than or equal to 1"),
        ({"threshold": -0.1}, "threshold: Input should be greater than or equal to 0"),
        (
            {"threshold": "lots"},
            "threshold: Input should be a valid number, unable to parse string as a number",
        ),
        ({"top": 0}, "top: Input should be greater than or equal to 1"),
        ({"hops": 3}, "hops: Input should be less than or equal to 2"),
        ({"nodes": 51}, "nodes: Input should be less than or equal to 50"),
        ({"position": 15}, "Position 15 is past the prompt's 15 tokens (positions 0–14)."),
        ({"target": "#300"}, "No token #300: token ids run 0–299."),
        ({"intervene": "L3K1"}, "L3K1: layer 3 does not exist; layers are 0–2."),
    ],
)
def test_bad_parameters_are_a_400_in_the_error_shape(client, slug, params, message):
    response = client.get(f"/m/{slug}/trace/circuit.json", params={"text": PROMPT} | params)
    assert response.status_code == 400
    assert response.json() == {"ok": False, "error": message, "status": 400}
    page = client.get(f"/m/{slug}/trace/circuit", params={"text": PROMPT} | params)
    assert page.status_code == 400


def test_the_page_links_every_node_and_escapes_the_target(client, slug):
    hostile = "<b>x"
    page = client.get(f"/m/{slug}/trace/circuit", params={"text": PROMPT, "target": hostile, "top": 2})
    assert page.status_code == 200
    body = client.get(
        f"/m/{slug}/trace/circuit.json", params={"text": PROMPT, "target": hostile, "top": 2}
    ).json()
    assert "<b>x" not in page.text and 'value="&lt;b&gt;x"' in page.text
    assert 'id="circuit-chart"' in page.text and 'id="circuit-edges"' in page.text
    table = page.text.split('id="circuit-nodes-table"')[1].split("</table>")[0]
    for node in body["nodes"]:
        assert f'<a href="{node["url"]}">L{node["layer"]}K{node["key"]}</a>' in table
    assert f'<link rel="alternate" type="application/json" href="/m/{slug}/trace/circuit.json?' in page.text
    assert f'href="{escape(body["trace_url"])}"' in page.text
    form = client.get(f"/m/{slug}/trace/circuit")  # no prompt: the form and where to start
    assert form.status_code == 200 and 'id="circuit-form"' in form.text


def test_the_live_view_links_its_target_s_circuit(client, slug):
    params = {"text": PROMPT, "position": 2, "target": " Paris"}
    body = client.get(f"/m/{slug}/trace.json", params=params).json()
    url = f"/m/{slug}/trace/circuit?text=The+capital+of+France+is&position=2&target=+Paris"
    assert body["attribution"]["circuit_url"] == url
    page = client.get(f"/m/{slug}/trace", params=params).text
    assert f'<a id="circuit-of-target" href="{escape(url)}">Memory circuit</a>' in page
    assert client.get(url).status_code == 200


def node(layer: int, key: int, hop: int, contribution: float) -> CircuitMemory:
    url = f"/m/x/layers/{layer}/keys/{key}"
    return CircuitMemory(
        layer=layer, key=key, coefficient=1.0, contribution=contribution, hop=hop, upstream_sum=None,
        top_token=None, url=url,
    )  # fmt: skip


def edge(up: CircuitMemory, down: CircuitMemory, term: float) -> CircuitEdgeAnswer:
    return CircuitEdgeAnswer(
        upstream=MemoryRefAnswer(layer=up.layer, key=up.key),
        downstream=MemoryRefAnswer(layer=down.layer, key=down.key),
        term=term,
        coefficient=1.0,
    )


def test_the_circuit_chart_names_only_its_layers_and_strongest_memories():
    """Issue 39 (4): at hops = 2 the chart was a hairball over an axis from −1 to 31 with every node named.
    Now a column per layer present, named "L12"; the CIRCUIT_LABELS strongest memories named, above their
    node in even columns and below it in odd ones; per hop the CIRCUIT_EDGES strongest edges drawn, and only
    the memories on them (with hop 0's)."""
    layers = [28, 29, 20, 12, 7, 5]
    hop0 = [node(layer, key, hop=0, contribution=10 - key) for key, layer in enumerate(layers)]  # 10 … 5
    hop1 = [node(layer - 2, 100 + i, hop=1, contribution=0.1 * (i + 1)) for i, layer in enumerate(layers * 5)]
    hop2 = [node(3, 500 + i, hop=2, contribution=0.01) for i in range(40)]
    edges = [edge(up, hop0[i % 6], term=1 + i) for i, up in enumerate(hop1)]  # hop 1: terms 1 … 30
    edges += [edge(up, hop1[0], term=0.01 * (i + 1)) for i, up in enumerate(hop2)]  # hop 2: 0.01 … 0.4
    ctx = CircuitContext(
        title="circuit", model="x", text="a prompt", position=0, readout="norm", target=None,
        interventions="", options=CircuitOptions(hops=2), max_tokens=56, trace_url="/m/x/trace",
        nodes=hop0 + hop1 + hop2, edges=edges,
    )  # fmt: skip
    figure = circuit_graph(ctx)
    *lines, nodes = figure["data"]
    assert len(lines) == 2 * CIRCUIT_EDGES == 40  # per hop the strongest 20 of 30 and of 40
    terms = [1 + i for i in range(29, 9, -1)] + [0.01 * (i + 1) for i in range(39, 19, -1)]
    assert [line["line"]["width"] for line in lines] == pytest.approx([1 + 6 * term / 30 for term in terms])
    kept = {(e.upstream.layer, e.upstream.key) for e in edges[10:30] + edges[50:]} | {(26, 100)}
    drawn = [(n.layer, n.key) for n in hop0] + sorted(
        [(n.layer, n.key) for n in hop1 + hop2 if (n.layer, n.key) in kept],
        key=lambda m: (m[0] == 3 and m[1] >= 500, -m[1] if m[1] < 500 else m[1]),
    )  # hop 0, hop 1 by |contribution|, hop 2
    assert [row[1] for row in nodes["customdata"]] == [f"L{layer}K{key}" for layer, key in drawn]
    layout = figure["layout"]["xaxis"]
    assert layout["ticktext"] == ["L3", "L5", "L7", "L10", "L12", "L18", "L20", "L26", "L27", "L28", "L29"]
    assert layout["tickvals"] == list(range(11)) and layout["range"] == [-0.6, 10.6]
    assert nodes["x"][:6] == [9, 10, 6, 4, 2, 1]  # L28 … L5: their columns
    names = [text for text in nodes["text"] if text]
    assert names == [
        "L28K0",
        "L29K1",
        "L20K2",
        "L12K3",
        "L7K4",
        "L5K5",
        "L3K129",
        "L5K128",
    ]  # the 8 strongest
    positions = dict(zip(nodes["x"], nodes["textposition"], strict=True))
    assert positions == {i: "top center" if i % 2 == 0 else "bottom center" for i in range(11)}
    assert "%{text}" not in nodes["hovertemplate"]  # every node, named or not, names itself on hover
    assert nodes["hovertemplate"].startswith("%{customdata[1]} · hop %{customdata[4]}<br>")
    assert figure["layout"]["meta"] == {"links": True, "declutter": True}
