"""The live view through the web app and a real live worker (its ASGI app in-process), on the tiny
index, SQLite and Postgres: exact fields, numbers equal to the engine's, tokens from the index, the
one error shape for bad input, 503 with Retry-After when the worker is down or full, escaping."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from html import unescape

import httpx
import pytest
import torch
from browser_fixtures import run_coroutine
from fastapi.testclient import TestClient
from hand_trace import trace_by_hand
from markupsafe import escape
from sqlalchemy import select

from ffmem.config import Settings
from ffmem.engine.live.edited_forward import intervene
from ffmem.engine.live.interventions import Intervention
from ffmem.engine.live.protocol import (
    ForwardFigures,
    LayerAnswer,
    LayerFigures,
    MemoryAnswer,
    TraceAnswer,
)
from ffmem.engine.live.trace import trace
from ffmem.engine.paper.cases import CASES
from ffmem.engine.values.token_display import byte_form
from ffmem.store import memory_reads
from ffmem.store.models import Run, Sentence, Token
from ffmem.web.display import visible
from ffmem.web.main import create_app
from ffmem.web.worker_client import LiveWorker
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live, LiveError

PROMPT = "The capital of France is"  # 15 tokens of the tiny tokenizer
pytestmark = pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")
TRACE_FIELDS = {
    "page", "title", "model", "n_layers", "n_keys", "text", "position", "readout", "memories", "generate",
    "interventions", "max_tokens", "worker", "notice", "run", "tokens", "prediction", "top_tokens", "layers",
    "heatmap", "edits", "generation", "cases", "unedited", "heatmap_mode", "notice_field", "target",
    "attribution", "link", "prediction_prob", "circuit_url",
}  # fmt: skip
LAYER_FIELDS = {
    "layer",
    "top_r",
    "top_y",
    "top_o",
    "final_prob",
    "final_rank",
    "case",
    "settled",
    "agrees",
    "memories",
    "unedited",
}
FIGURE_FIELDS = {"top_r", "top_y", "top_o", "final_prob", "final_rank", "case", "settled"}
MEMORY_FIELDS = {
    "layer",
    "key",
    "coefficient",
    "unedited_coefficient",
    "score",
    "tokens",
    "agrees",
    "url",
    "edit",
    "off_url",
    "scale_url",
    "flip_url",
}


@pytest.fixture(scope="module")
def live(tiny, tiny_model_dir):
    live = Live(device="cpu", max_tokens=56, queue=4)
    live.models[str(tiny_model_dir)] = tiny
    return live


@pytest.fixture(scope="module")
def client(explorer_db, live):
    worker = TestClient(create_live_app(live), base_url="http://worker")
    settings = Settings(database_url=explorer_db, trace_rate_limit="0")  # dozens of live requests a minute
    app = create_app(settings, live=LiveWorker("http://worker", 30, client=worker))
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


def texts(db) -> dict[int, str]:
    """The vocabulary as the pages name it: a byte-level token that is no whole character as ⟨0x80⟩."""
    return {t.token_id: byte_form(t.text, t.piece) for t in db.scalars(select(Token))}


def token_id(names: dict[int, str], text: str) -> int:
    return next(t for t, name in names.items() if name == text)


def test_trace_json_equals_the_engine_named_with_the_index(client, db, slug, tiny):
    body = client.get(f"/m/{slug}/trace.json", params={"text": PROMPT, "memories": 5}).json()
    assert set(body) == TRACE_FIELDS
    ids = tiny.tokenizer(PROMPT).input_ids
    expected = trace(tiny, ids, memories=5)
    names = texts(db)
    assert [t["token_id"] for t in body["tokens"]] == ids
    assert [t["token"] for t in body["tokens"]] == [names[i] for i in ids]
    assert body["position"] == len(ids) - 1 and body["prediction"]["token_id"] == expected.prediction
    assert len(body["layers"]) == tiny.n_layers and sum(body["cases"].values()) == tiny.n_layers
    assert body["heatmap"]["active"] == expected.active
    assert body["unedited"] is None  # no edits: one forward pass, nothing beside it
    run_id = body["run"]
    for layer, want in zip(body["layers"], expected.layers, strict=True):
        assert set(layer) == LAYER_FIELDS and layer["unedited"] is None
        assert layer["top_y"] == {"token_id": want.top_y, "token": names[want.top_y]}
        assert layer["case"] == want.case and layer["final_prob"] == pytest.approx(want.final_prob)
        for memory, m in zip(layer["memories"], want.memories, strict=True):
            assert set(memory) == MEMORY_FIELDS and memory["unedited_coefficient"] is None
            assert (memory["key"], memory["coefficient"]) == (m.key, pytest.approx(m.coefficient))
            direction = 1 if m.coefficient >= 0 else -1  # m < 0: the value's bottom tokens
            where = dict(session=db, run_id=run_id, layer=m.layer, key=m.key)
            listed = memory_reads.get_value_tokens(**where, readout="norm", direction=direction)
            stored = [v.token_id for v in listed[:5]]
            assert [t["token_id"] for t in memory["tokens"]] == stored
            assert memory["agrees"] == (want.top_y in stored)
            assert memory["url"] == f"/m/{slug}/layers/{m.layer}/keys/{m.key}"
            assert memory["off_url"].endswith(f"intervene=L{m.layer}K{m.key}&memories=5")
        assert layer["agrees"] == any(m["agrees"] for m in layer["memories"])


def test_the_circuit_is_opened_from_the_live_views_controls(client, slug):
    """Issue 39 (5): a link beside the trace button opens this prompt's circuit (position, edits kept)."""
    params = {"text": PROMPT, "position": 3, "intervene": "L1K7*-1"}
    body = client.get(f"/m/{slug}/trace.json", params=params).json()
    want = f"/m/{slug}/trace/circuit?text=The+capital+of+France+is&position=3&intervene=L1K7%2A-1"
    assert body["circuit_url"] == want
    page = client.get(f"/m/{slug}/trace", params=params).text
    start = page.index('<div class="controls">')
    controls = page[start : page.index("</form>", start)]
    assert f'<a id="open-circuit" class="button-link" href="{escape(want)}"' in controls
    assert client.get(want).status_code == 200
    assert 'id="open-circuit"' not in client.get(f"/m/{slug}/trace").text  # no prompt: no circuit


def test_interventions_in_the_url_rerun_the_prediction(client, slug, tiny):
    params = {"text": PROMPT, "intervene": "L2K3,L1K7*-1", "generate": 4}
    body = client.get(f"/m/{slug}/trace.json", params=params).json()
    assert body["interventions"] == "L2K3,L1K7*-1"
    assert [(e["text"], e["mode"], e["value"]) for e in body["edits"]] == [
        ("L2K3", "off", 0.0),
        ("L1K7*-1", "scale", -1.0),
    ]
    assert (
        body["edits"][0]["remove_url"]
        == f"/m/{slug}/trace?text=The+capital+of+France+is&intervene=L1K7%2A-1&generate=4"
    )
    ids = tiny.tokenizer(PROMPT).input_ids
    edits = [Intervention(2, 3, "off"), Intervention(1, 7, "scale", -1.0)]
    with torch.inference_mode():
        before = tiny.model(torch.tensor([ids])).logits[0, -1].softmax(-1)
        with intervene(tiny, edits):
            after = tiny.model(torch.tensor([ids])).logits[0, -1].softmax(-1)
    for change in body["top_tokens"]:
        assert change["before"] == pytest.approx(float(before[change["token_id"]]), abs=1e-5)
        assert change["after"] == pytest.approx(float(after[change["token_id"]]), abs=1e-5)
        assert change["change"] == pytest.approx(change["after"] - change["before"])
    expected = trace(tiny, ids, interventions=edits, generate_tokens=4)
    assert body["generation"] == {
        "tokens": 4,
        "clean": tiny.tokenizer.decode(expected.generated),
        "edited": tiny.tokenizer.decode(expected.generated_edited),
    }
    edited = [m for layer in body["layers"] for m in layer["memories"] if m["edit"]]
    assert all(m["edit"] in ("L2K3", "L1K7*-1") for m in edited)


EDITS = "L0K3=-20,L1K7*-1"  # on PROMPT they change the prediction of the tiny model


def test_the_confidence_chart_ends_after_the_last_layer_at_the_prediction(client, slug, tiny):
    """Issue 39 (2): a point per layer for the residual entering its FF, then one after the last layer: the
    model's own probability of its prediction (edited and unedited passes alike), and the axis says so."""
    body = client.get(f"/m/{slug}/trace.json", params={"text": PROMPT, "intervene": EDITS}).json()
    ids = tiny.tokenizer(PROMPT).input_ids
    with torch.inference_mode():
        clean = tiny.model(torch.tensor([ids])).logits[0, -1].softmax(-1)
        with intervene(tiny, [Intervention(0, 3, "set", -20.0), Intervention(1, 7, "scale", -1.0)]):
            edited = tiny.model(torch.tensor([ids])).logits[0, -1].softmax(-1)
    prediction, was = body["prediction"]["token_id"], body["unedited"]["prediction"]["token_id"]
    assert prediction == int(edited.argmax()) and was == int(clean.argmax()) != prediction
    assert body["prediction_prob"] == pytest.approx(float(edited[prediction]), abs=1e-5)
    assert body["unedited"]["prediction_prob"] == pytest.approx(float(clean[was]), abs=1e-5)
    page = client.get(f"/m/{slug}/trace", params={"text": PROMPT, "intervene": EDITS}).text
    figure = json.loads(unescape(re.search(r'id="confidence-chart" data-figure="([^"]*)"', page).group(1)))
    mine, theirs = figure["data"]
    assert mine["x"] == theirs["x"] == [0, 1, 2, 3]  # 3 layers, then after the last one
    assert mine["y"] == [*(row["final_prob"] for row in body["layers"]), body["prediction_prob"]]
    assert theirs["y"] == [
        *(row["unedited"]["final_prob"] for row in body["layers"]),
        body["unedited"]["prediction_prob"],
    ]
    assert mine["text"] == [
        "entering layer 0's FF",
        "entering layer 1's FF",
        "entering layer 2's FF",
        "after the last layer",
    ]
    axis = figure["layout"]["xaxis"]
    assert (axis["tickvals"], axis["ticktext"]) == ([0, 1, 2, 3], ["0", "1", "2", "out"])
    assert axis["title"]["text"] == "entering layer ℓ's FF · out: after the last layer"
    fields = client.get("/openapi.json").json()["components"]["schemas"]
    assert fields["LayerFiguresView"]["properties"]["final_prob"]["description"] == (
        "Probability of that pass's final prediction under the residual entering layer ℓ's FF "
        "(this layer's own FF not yet added; after the last layer: the trace's `prediction_prob`)."
    )
    assert fields["TraceContext"]["properties"]["prediction_prob"]["description"].startswith(
        "The prediction's probability after the last layer (the model's output)"
    )


def test_with_edits_every_figure_is_the_edited_pass_with_the_unedited_beside(client, slug, tiny):
    """Issue 13: the layer table, p(final | r), rank, cases, settled and the heatmaps come from the forward
    pass under the edits (equal to a trace computed by hand under them); the unedited figures beside them
    equal a trace by hand without them."""
    body = client.get(f"/m/{slug}/trace.json", params={"text": PROMPT, "intervene": EDITS}).json()
    ids = tiny.tokenizer(PROMPT).input_ids
    p = len(ids) - 1
    edits = [Intervention(0, 3, "set", -20.0), Intervention(1, 7, "scale", -1.0)]
    edited, clean = trace_by_hand(tiny, ids, p, "norm", edits), trace_by_hand(tiny, ids, p, "norm")
    assert edited.prediction != clean.prediction  # else this test could not tell the passes apart
    assert set(body) == TRACE_FIELDS and set(body["unedited"]) == {
        "prediction",
        "prediction_prob",
        "heatmap",
        "cases",
    }
    assert body["prediction"]["token_id"] == edited.prediction
    assert body["unedited"]["prediction"]["token_id"] == clean.prediction
    for hand, heatmap, cases, layers in (
        (edited, body["heatmap"], body["cases"], body["layers"]),
        (
            clean,
            body["unedited"]["heatmap"],
            body["unedited"]["cases"],
            [row["unedited"] for row in body["layers"]],
        ),
    ):
        assert heatmap["active"] == hand.active
        for got, want in zip(heatmap["ff_logit"], hand.ff_logit, strict=True):
            assert got == pytest.approx(want, abs=1e-3)
        assert cases == {case: sum(row.case == case for row in hand.layers) for case in CASES}
        for row, want in zip(layers, hand.layers, strict=True):
            assert set(FIGURE_FIELDS) <= set(row)
            assert [row[f"top_{x}"]["token_id"] for x in "ryo"] == [want.top_r, want.top_y, want.top_o]
            assert (row["final_rank"], row["case"], row["settled"]) == (
                want.final_rank,
                want.case,
                want.settled,
            )
            assert row["final_prob"] == pytest.approx(want.final_prob, abs=1e-4)
    for row, want, was in zip(body["layers"], edited.layers, clean.layers, strict=True):
        assert set(row["unedited"]) == FIGURE_FIELDS
        for memory in row["memories"]:
            assert memory["coefficient"] == pytest.approx(float(want.m[memory["key"]]), abs=1e-4)
            assert memory["unedited_coefficient"] == pytest.approx(float(was.m[memory["key"]]), abs=1e-4)
    # The page shows the edited figures and, muted, what they were where the edits changed them.
    page = client.get(f"/m/{slug}/trace", params={"text": PROMPT, "intervene": EDITS}).text
    assert (
        f'with the edits (<span id="unedited-prediction">without them <code class="tok" '
        f'title="token id {clean.prediction}">' in page
    )
    changed = [(e, c) for e, c in zip(edited.layers, clean.layers, strict=True) if e.top_o != c.top_o]
    assert changed
    for e, c in changed:
        assert f'title="token id {e.top_o}">' in page
        assert (
            f'<span class="was" title="without the edits">was <code class="tok" title="token id {c.top_o}">'
            in page
        )
    plain = client.get(f"/m/{slug}/trace", params={"text": PROMPT}).text
    assert 'class="was"' not in plain and "unedited-prediction" not in plain


def test_the_worker_answers_the_one_contract(live, tiny_model_dir):
    """Issue 14: the worker answers TraceAnswer and AblationAnswer (ffmem/engine/live/protocol.py), the
    models the web process parses; its OpenAPI document says so."""
    worker = TestClient(create_live_app(live), base_url="http://worker")
    request = {"model": str(tiny_model_dir), "text": PROMPT, "memories": 2, "interventions": EDITS}
    body = worker.post("/trace", json=request).json()
    assert set(body) == set(TraceAnswer.model_fields)
    assert set(body["layers"][0]) == set(LayerAnswer.model_fields)
    assert set(body["layers"][0]["memories"][0]) == set(MemoryAnswer.model_fields)
    assert set(body["unedited"]) == set(ForwardFigures.model_fields)
    assert set(body["unedited"]["layers"][0]) == set(LayerFigures.model_fields)
    assert body["interventions"] == [
        {"layer": 0, "key": 3, "mode": "set", "value": -20.0},
        {"layer": 1, "key": 7, "mode": "scale", "value": -1.0},
    ]
    assert TraceAnswer.model_validate(body).model_dump(mode="json") == body
    plain = worker.post("/trace", json=request | {"interventions": ""}).json()
    assert plain["unedited"] is None and plain["interventions"] == []
    ablation = {"model": str(tiny_model_dir), "layer": 1, "key": 4, "prefixes": [[5, 6]], "targets": [[7, 8]]}
    answer = worker.post("/ablation", json=ablation).json()
    assert set(answer) == {"before", "after"} and len(answer["before"][0]) == 2
    paths = worker.get("/openapi.json").json()["paths"]
    for path, model in (("/trace", "TraceAnswer"), ("/ablation", "AblationAnswer")):
        assert paths[path]["post"]["responses"]["200"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }


def test_an_answer_of_another_shape_is_a_502_in_the_error_shape(explorer_db, slug):
    """A worker of another version answers something the contract does not read: a 502 that says so."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ready"})
        return httpx.Response(200, json={"token_ids": "nope"})

    odd = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://odd")
    app = create_app(Settings(database_url=explorer_db), live=LiveWorker("http://odd", 5, client=odd))
    with TestClient(app) as client:
        response = client.get(f"/m/{slug}/trace.json", params={"text": PROMPT})
    app.state.engine.dispose()
    assert response.status_code == 502
    assert response.json() == {
        "ok": False,
        "error": "The live worker at http://odd answered a TraceAnswer this explorer cannot read "
        "(token_ids: Input should be a valid list); run the same ffmem version on both.",
        "status": 502,
    }


def test_the_page_and_its_htmx_fragment(client, slug):
    page = client.get(f"/m/{slug}/trace", params={"text": PROMPT, "position": 1})
    assert page.status_code == 200 and "<html" in page.text
    assert 'id="token-1" class="chip selected"' in page.text and 'id="trace-heatmap"' in page.text
    assert f'href="/m/{slug}/trace.json?text=The+capital+of+France+is&amp;position=1"' in page.text
    fragment = client.get(
        f"/m/{slug}/trace",
        params={"text": PROMPT, "position": 2},
        headers={"HX-Request": "true", "HX-Target": "trace"},
    )
    assert "<html" not in fragment.text and 'id="token-2" class="chip selected"' in fragment.text
    form = client.get(f"/m/{slug}/trace")
    assert (
        form.status_code == 200 and 'id="prompt"' in form.text and "live worker: <strong>ready" in form.text
    )
    intro = '<p class="meta" id="trace-intro">Type a prompt and watch one forward pass build the next-token'
    for shown in (page.text, form.text):  # a heading and a one-line intro, with a trace or without
        assert shown.count("<h1>") == 1 and f"<h1>Live view of {slug}</h1>\n{intro}" in shown
    assert "<h1>" not in fragment.text and 'id="trace-intro"' not in fragment.text  # the swap keeps them


def test_the_prompt_is_escaped(client, slug):
    hostile = '<script>alert(1)</script> "><img src=x onerror=alert(1)>'
    page = client.get(f"/m/{slug}/trace", params={"text": hostile})
    assert page.status_code == 200
    assert "<script>alert(1)</script>" not in page.text and "<img src=x" not in page.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"text": ""}, "The prompt is empty: type some text."),
        ({"text": "   "}, "The prompt is empty: type some text."),
        ({"text": "a " * 60}, "The prompt has 61 tokens; the limit is 56 (max_prompt_tokens)."),
        ({"text": PROMPT, "position": 15}, "Position 15 is past the prompt's 15 tokens (positions 0–14)."),
        ({"text": PROMPT, "intervene": "L3K1"}, "L3K1: layer 3 does not exist; layers are 0–2."),
        ({"text": PROMPT, "intervene": "L0K48"}, "L0K48: key 48 does not exist; keys are 0–47."),
        (
            {"text": PROMPT, "intervene": "nope"},
            "Cannot read intervention 'nope': write L12K345 (off), L12K345*0.5 (scale) or L12K345=3.2 "
            "(force on), comma separated.",
        ),
        ({"text": PROMPT, "position": -1}, "position: Input should be greater than or equal to 0"),
        ({"text": PROMPT, "generate": 21}, "generate: Input should be less than or equal to 20"),
        ({"text": PROMPT, "readout": "lens"}, "readout: Input should be 'norm' or 'raw'"),
    ],
)
def test_bad_input_is_a_400_that_says_what_is_allowed(client, slug, params, message):
    response = client.get(f"/m/{slug}/trace.json", params=params)
    assert response.status_code == 400
    assert response.json() == {"ok": False, "error": message, "status": 400}
    page = client.get(f"/m/{slug}/trace", params=params)
    assert page.status_code == 400
    if "Input should" not in message:  # not a malformed parameter: the form again, with the reason (next
        # to the prompt or the edits when one of them is the cause, else in a notice)
        assert 'id="prompt"' in page.text and str(escape(message)) in page.text


def test_a_huge_prompt_is_refused_before_the_worker(client, explorer_db, slug):
    """20,000 characters: past the query limit a 414 at the door; with a higher limit, a 400 before
    the worker tokenizes it (more than 32 characters a token)."""
    params = {"text": "a" * 20000}
    assert client.get(f"/m/{slug}/trace.json", params=params).status_code == 414
    app = create_app(Settings(database_url=explorer_db, max_query_bytes=100_000))
    with TestClient(app) as roomy:
        response = roomy.get(f"/m/{slug}/trace.json", params=params)
    app.state.engine.dispose()
    assert response.json() == {"ok": False, "error": "Prompts are limited to 512 tokens.", "status": 400}
    # The box refuses what the server refuses: 32 characters a token.
    assert (
        '<textarea id="prompt" name="text" rows="2" placeholder="The capital of France is" maxlength="16384"'
        in (client.get(f"/m/{slug}/trace").text)
    )


def test_unknown_model_is_a_404(client):
    response = client.get("/m/nope/trace.json", params={"text": PROMPT})
    assert response.status_code == 404 and response.json()["ok"] is False


def test_a_down_worker_is_a_clear_503_and_browsing_goes_on(explorer_db, slug):
    app = create_app(Settings(database_url=explorer_db, worker_url="http://127.0.0.1:9"))
    with TestClient(app) as client:
        response = client.get(f"/m/{slug}/trace.json", params={"text": PROMPT})
        assert response.status_code == 503 and response.headers["retry-after"] == "5"
        assert response.json()["error"].startswith("No live worker answers at http://127.0.0.1:9")
        page = client.get(f"/m/{slug}/trace", params={"text": PROMPT})
        assert (
            page.status_code == 503
            and "No live trace</strong> — Live worker unavailable: No live worker answers" in page.text
            and 'id="prompt"' in page.text
        )
        assert "live worker: <strong>down" in client.get(f"/m/{slug}/trace").text
        assert client.get(f"/m/{slug}/layers/0/keys/0.json").status_code == 200
    app.state.engine.dispose()


def test_a_full_queue_answers_503_with_retry_after(tiny, tiny_model_dir):
    """One trace at a time, `queue` waiting: the next one is refused at once, not piled up."""
    live = Live(device="cpu", queue=2)
    live.models[str(tiny_model_dir)] = tiny
    gate = threading.Event()

    async def burst():
        blocked = [
            asyncio.ensure_future(live.run(str(tiny_model_dir), lambda m: gate.wait(10) and {}))
            for _ in range(2)
        ]
        await asyncio.sleep(0.05)
        with pytest.raises(LiveError) as refused:
            await live.run(str(tiny_model_dir), lambda m: {})
        gate.set()
        await asyncio.gather(*blocked)
        return refused.value

    refused = run_coroutine(burst())
    assert (refused.status, refused.retry_after) == (503, 1)
    assert refused.message == "the live worker is busy (2 traces waiting); try again shortly"
    assert live.pending == 0


def test_the_worker_refuses_while_the_model_loads(client, slug, live, tiny_model_dir):
    live.loading = str(tiny_model_dir)
    try:
        response = client.get(f"/m/{slug}/trace.json", params={"text": PROMPT})
    finally:
        live.loading = None
    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    assert "still loading" in response.json()["error"]


def test_switching_a_memory_off_on_its_top_triggers(client, db, slug, tiny):
    body = client.get(f"/m/{slug}/layers/1/keys/4/ablation.json", params={"triggers": 3}).json()
    run_id = body["run"]
    where = dict(session=db, run_id=run_id, layer=1, key=4)
    triggers = memory_reads.get_triggers(**where, sign=1, limit=3)
    top = memory_reads.get_value_tokens(**where, readout="raw", direction=1)[0].token_id
    assert body["value_token"]["token_id"] == top and len(body["rows"]) == len(triggers)
    corpus = db.get(Run, run_id).corpus_id
    for row, trigger in zip(body["rows"], triggers, strict=True):
        sentence = db.get(Sentence, (corpus, trigger.sentence_index))
        prefix = sentence.token_ids[: trigger.position + 1]
        assert row["prefix"] == sentence.text[: sentence.offsets[trigger.position][1]]
        assert row["coefficient"] == pytest.approx(trigger.coefficient)
        with torch.inference_mode():
            on = tiny.model(torch.tensor([prefix])).logits[0, -1].softmax(-1)
            with intervene(tiny, [Intervention(1, 4, "off")]):
                off = tiny.model(torch.tensor([prefix])).logits[0, -1].softmax(-1)
        assert (row["value_before"], row["value_after"]) == (
            pytest.approx(float(on[top]), abs=1e-5),
            pytest.approx(float(off[top]), abs=1e-5),
        )
        following = (
            sentence.token_ids[trigger.position + 1]
            if trigger.position + 1 < len(sentence.token_ids)
            else None
        )
        if following is None:
            assert row["next_token"] is None and row["next_before"] is None
        else:
            assert row["next_token"]["token_id"] == following
            assert row["next_after"] == pytest.approx(float(off[following]), abs=1e-5)
    rows = body["rows"]
    assert body["mean_value_change"] == pytest.approx(
        sum(r["value_after"] - r["value_before"] for r in rows) / len(rows)
    )
    fragment = client.get(
        f"/m/{slug}/layers/1/keys/4/ablation", headers={"HX-Request": "true", "HX-Target": "ablation"}
    )
    assert (
        fragment.status_code == 200
        and "<html" not in fragment.text
        and "switching the memory off" in fragment.text
    )
    key_page = client.get(f"/m/{slug}/layers/1/keys/4").text
    assert f'hx-get="/m/{slug}/layers/1/keys/4/ablation?run={run_id}"' in key_page


def test_a_slow_worker_is_a_504_in_the_error_shape(explorer_db, slug):
    """The worker answers /health but not /trace: after settings.worker_timeout the app answers 504."""
    from browser_fixtures import serving
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    released = threading.Event()

    async def stuck(request):
        while not released.is_set():
            await asyncio.sleep(0.02)
        return JSONResponse({})

    async def ready(request):
        return JSONResponse({"status": "ready"})

    worker = Starlette(routes=[Route("/trace", stuck, methods=["POST"]), Route("/health", ready)])
    with serving(worker) as port:
        url = f"http://127.0.0.1:{port}"
        app = create_app(Settings(database_url=explorer_db, worker_url=url, worker_timeout=0.3))
        try:
            with TestClient(app) as client:
                response = client.get(f"/m/{slug}/trace.json", params={"text": PROMPT})
                page = client.get(f"/m/{slug}/trace", params={"text": PROMPT})
        finally:
            released.set()
            app.state.engine.dispose()
    message = f"The live worker at {url} did not answer in time; try a shorter prompt."
    assert response.status_code == 504
    assert response.json() == {"ok": False, "error": message, "status": 504}
    assert page.status_code == 504
    assert f"No live trace</strong> — Live worker timed out: {message}" in page.text


ATTRIBUTION_FIELDS = {
    "target", "typed", "note", "other", "other_url", "readout", "logit", "scale", "total", "largest_residual",
    "vetoes", "layers", "promoters", "suppressors", "circuit_url",
}  # fmt: skip
ATTRIBUTION_LAYER_FIELDS = {"layer", "memories", "memories_sum", "bias", "direct", "change", "residual"}
ATTRIBUTED_FIELDS = {"layer", "key", "coefficient", "value_logit", "contribution", "top_token", "veto", "url"}


def by_hand_raw(tiny, ids, target):
    """Per layer Σ_i m_i·(v_i·e_t) and y·e_t, from plain hooks on the Llama's down_proj and mlp."""
    m, y = {}, {}
    handles = []
    for layer, block in enumerate(tiny.model.model.layers):
        handles.append(
            block.mlp.down_proj.register_forward_pre_hook(
                lambda mod, i, layer=layer: m.update({layer: i[0][0, -1]})
            )
        )
        handles.append(
            block.mlp.register_forward_hook(lambda mod, i, o, layer=layer: y.update({layer: o[0, -1]}))
        )
    try:
        with torch.inference_mode():
            tiny.model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    with torch.inference_mode():
        e = tiny.model.lm_head.weight[target]  # [d]
        values = [block.mlp.down_proj.weight.T for block in tiny.model.model.layers]  # [d_ff, d] each
        sums = [float(m[layer] @ (values[layer] @ e)) for layer in m]
        return sums, [float(y[layer] @ e) for layer in y]


@pytest.mark.parametrize("readout", ["raw", "norm"])
def test_attribution_json_twin(client, db, slug, tiny, readout):
    """Issue 17: who pushes the prediction (the default target), in the JSON twin: exact fields, the
    engine's numbers, per layer Σ memories = y·e_t by hand (raw), own top tokens from the index and the
    veto marks by their definition."""
    params = {"text": PROMPT, "memories": 6, "readout": readout}
    body = client.get(f"/m/{slug}/trace.json", params=params).json()
    a = body["attribution"]
    assert body["target"] is None and set(a) == ATTRIBUTION_FIELDS
    ids = tiny.tokenizer(PROMPT).input_ids
    expected = trace(tiny, ids, memories=6, readout=readout).attribution
    names = texts(db)
    assert a["target"] == {"token_id": body["prediction"]["token_id"], "token": names[expected.target]}
    assert (a["typed"], a["note"], a["readout"]) == (None, None, readout)
    assert a["logit"] == pytest.approx(expected.logit) and a["total"] == pytest.approx(expected.total)
    assert (a["scale"] is None) == (readout == "raw")
    assert a["largest_residual"] == pytest.approx(max(abs(row.residual) for row in expected.layers))
    sums, changes = by_hand_raw(tiny, ids, expected.target)
    run_id = body["run"]
    vetoes = 0
    for row, want in zip(a["layers"], expected.layers, strict=True):
        assert set(row) == ATTRIBUTION_LAYER_FIELDS and len(row["memories"]) == 6
        assert row["memories_sum"] == pytest.approx(want.memories_sum, abs=1e-5)
        assert row["change"] == pytest.approx(want.change, abs=1e-5) and row["bias"] == 0.0
        if readout == "raw":  # exact up to float error, against hooks by hand
            assert row["memories_sum"] == pytest.approx(sums[row["layer"]], abs=1e-4)
            assert row["change"] == pytest.approx(changes[row["layer"]], abs=1e-4)
            assert abs(row["residual"]) < 1e-4
        largest = max(abs(m["contribution"]) for m in row["memories"])
        for memory, m in zip(row["memories"], want.memories, strict=True):
            assert set(memory) == ATTRIBUTED_FIELDS
            assert (memory["key"], memory["contribution"]) == (m.key, pytest.approx(m.contribution, abs=1e-5))
            assert memory["url"] == f"/m/{slug}/layers/{m.layer}/keys/{m.key}"
            direction = 1 if m.coefficient >= 0 else -1
            top = memory_reads.get_value_tokens(
                session=db, run_id=run_id, layer=m.layer, key=m.key, readout=readout, direction=direction
            )[0].token_id
            assert memory["top_token"] == {"token_id": top, "token": names[top]}
            veto = row["memories_sum"] < 0 and (
                top == expected.target or (m.contribution > 0 and m.contribution >= 0.25 * largest)
            )
            assert memory["veto"] == veto, (row["layer"], m.key)
            vetoes += veto
    assert a["vetoes"] == vetoes
    if readout == "raw":  # layer 1 pushes the prediction down while some of its memories push it up
        assert [m["veto"] for m in a["layers"][1]["memories"]].count(True) >= 1
    promoted = sorted((m for w in expected.layers for m in w.memories), key=lambda m: -m.contribution)
    assert a["promoters"][0]["contribution"] == pytest.approx(promoted[0].contribution, abs=1e-5)
    assert [p["contribution"] for p in a["promoters"]] == pytest.approx(
        [p.contribution for p in expected.promoters], abs=1e-5
    )
    assert [s["key"] for s in a["suppressors"]] == [s.key for s in expected.suppressors]


def test_a_typed_target_is_tokenized_by_the_worker_and_shared_in_the_url(client, db, slug, tiny):
    """target= ' Paris' (two tokens of the tiny tokenizer: the first is attributed, and the page says so),
    and #id; the URLs of the page keep the target."""
    pieces = tiny.tokenizer(" Paris", add_special_tokens=False).input_ids
    assert len(pieces) == 2
    body = client.get(f"/m/{slug}/trace.json", params={"text": PROMPT, "target": " Paris"}).json()
    a, names = body["attribution"], texts(db)
    assert body["target"] == " Paris" and a["typed"] == " Paris"
    assert a["target"] == {"token_id": pieces[0], "token": names[pieces[0]]}
    (first, second), paris = (f"{visible(names[t])} #{t}" for t in pieces), token_id(names, "Paris")
    assert a["note"] == (
        f"The target “␣Paris” is 2 tokens ({first} + {second}): the first, {first}, is attributed. "
        f"Without a leading space it is another token, Paris #{paris}."
    )
    assert a["other"] == {"token_id": paris, "token": "Paris"}
    assert a["other_url"] == f"/m/{slug}/trace?text=The+capital+of+France+is&target=%23{paris}"
    ids = tiny.tokenizer(PROMPT).input_ids
    expected = trace(tiny, ids, target=pieces[0]).attribution
    assert a["total"] == pytest.approx(expected.total, abs=1e-5)
    assert (
        body["tokens"][3]["url"] == f"/m/{slug}/trace?text=The+capital+of+France+is&position=3&target=+Paris"
    )
    assert body["layers"][0]["memories"][0]["off_url"].endswith("&target=+Paris")
    by_id = client.get(f"/m/{slug}/trace.json", params={"text": PROMPT, "target": "#7"}).json()["attribution"]
    assert (
        by_id["target"]["token_id"] == 7
        and (by_id["note"], by_id["other"], by_id["other_url"]) == (None,) * 3
    )
    assert by_id["total"] == pytest.approx(trace(tiny, ids, target=7).attribution.total, abs=1e-5)
    tops = body["top_tokens"]
    assert tops[0]["target_url"] == (
        f"/m/{slug}/trace?text=The+capital+of+France+is&target=%23{tops[0]['token_id']}"
    )


def test_a_typed_target_says_which_token_it_is_and_offers_its_other_spelling(client, db, slug):
    """Issue 26 (7): `a` is token #65 and ` a` #264 is one token too: the note names the token taken as the
    pages show tokens, and the page links the same trace with ` a` as the target; `Paris` has no
    one-token ` Paris` in the tiny vocabulary, so nothing is offered."""
    names = texts(db)
    assert (names[65], names[264]) == ("a", " a")
    body = client.get(f"/m/{slug}/trace.json", params={"text": PROMPT, "target": "a"}).json()
    a = body["attribution"]
    assert a["target"] == {"token_id": 65, "token": "a"}
    assert (
        a["note"] == "The target “a” is the token a #65. With a leading space it is another token, ␣a #264."
    )
    assert a["other"] == {"token_id": 264, "token": " a"}
    assert a["other_url"] == f"/m/{slug}/trace?text=The+capital+of+France+is&target=%23264"
    page = client.get(f"/m/{slug}/trace", params={"text": PROMPT, "target": "a"}).text
    note = page.split('id="target-note"')[1].split("</p>")[0]
    assert note == (
        ' role="status">The target “a” is the token a #65. With a leading space it is another token, ␣a #264.'
        f' <a id="target-other" href="/m/{slug}/trace?text=The+capital+of+France+is&amp;target=%23264"'
        ' hx-boost="true" hx-target="#trace" hx-push-url="true">Attribute'
        ' <code class="tok" title="token id 264">␣a</code> instead</a>'
    )
    paris = token_id(names, "Paris")
    one = client.get(f"/m/{slug}/trace.json", params={"text": PROMPT, "target": "Paris"}).json()[
        "attribution"
    ]
    assert one["note"] == f"The target “Paris” is the token Paris #{paris}."
    assert (one["other"], one["other_url"]) == (None, None)
    assert (
        'id="target-other"'
        not in client.get(f"/m/{slug}/trace", params={"text": PROMPT, "target": "Paris"}).text
    )


def test_a_target_note_shows_byte_level_tokens_as_their_bytes(client, db, slug, tiny):
    """Issue 26 (14): `é` is two byte-level tokens of the tiny tokenizer, 0xC3 and the lone continuation
    byte 0xA9, each "�" decoded alone; the note names them as the value tables do, ⟨0xC3⟩ and ⟨0xA9⟩."""
    lead, continuation = tiny.tokenizer("é", add_special_tokens=False).input_ids
    assert tiny.tokenizer.decode([continuation]) == "\ufffd"
    body = client.get(f"/m/{slug}/trace.json", params={"text": PROMPT, "target": "é"}).json()
    a = body["attribution"]
    assert a["target"] == {"token_id": lead, "token": "⟨0xC3⟩"}
    assert a["note"] == (
        f"The target “é” is 2 tokens (⟨0xC3⟩ #{lead} + ⟨0xA9⟩ #{continuation}): "
        f"the first, ⟨0xC3⟩ #{lead}, is attributed."
    )
    page = client.get(f"/m/{slug}/trace", params={"text": PROMPT, "target": "é"}).text
    assert f'<code class="tok" title="token id {lead}">⟨0xC3⟩</code>' in page.split('id="attribution"')[1]
    assert "\ufffd" not in page.split('id="target-note"')[1].split("</p>")[0]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("", "The target is empty: type a token, e.g. ' London', or leave it out."),
        ("x" * 101, "A target is one token: at most 100 characters."),
        ("#300", "No token #300: token ids run 0–299."),
        ("#99999999", "No token #99999999: token ids run 0–299."),
    ],
)
def test_a_bad_target_is_a_400_next_to_its_field(client, slug, target, message):
    params = {"text": PROMPT, "target": target}
    response = client.get(f"/m/{slug}/trace.json", params=params)
    assert response.status_code == 400
    assert response.json() == {"ok": False, "error": message, "status": 400}
    fragment = client.get(
        f"/m/{slug}/trace", params=params, headers={"HX-Request": "true", "HX-Target": "trace"}
    )
    assert fragment.status_code == 400 and fragment.headers["X-Error-Field"] == "target"
    page = client.get(f"/m/{slug}/trace", params=params)
    assert page.status_code == 400 and 'id="target-error"' in page.text
    assert str(escape(message)) in page.text.split('id="target-error"')[1].split("</span>")[0]


def test_the_attribution_section_is_rendered_and_escaped(client, slug):
    hostile = "<b>x"
    page = client.get(f"/m/{slug}/trace", params={"text": PROMPT, "target": hostile, "readout": "raw"})
    assert page.status_code == 200
    assert 'id="attribution"' in page.text and 'id="attribution-layers"' in page.text
    assert "<b>x" not in page.text and "&lt;b&gt;x" in page.text
    assert 'id="target-note"' in page.text and 'id="attribution-legend"' in page.text
    assert f'href="/m/{slug}/layers/0/keys/' in page.text.split('id="attribution"')[1]
