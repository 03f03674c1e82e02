"""Issue 15, "try your own text on this key": the live worker's POST /coefficients equals a hand
computation of act(x·g)·(x·u) from the weights and the layer's input (hooks written here, not ffmem's);
the key page's try-text section (`?text=`, its JSON twin and its htmx fragment) equals ffmem.engine's
capture on the same text and ranks its max and min among the stored triggers; bad texts are 400s in the
one error shape, shown next to the box on the page; a down worker or a spent budget leaves the key page
rendered, with the reason in the section."""

from __future__ import annotations

import re

import pytest
import torch
from fastapi.testclient import TestClient
from markupsafe import escape

from ffmem.config import Settings
from ffmem.engine.live.protocol import CoefficientsAnswer
from ffmem.engine.model.hooks import capture
from ffmem.store import memory_reads
from ffmem.store.models import Run
from ffmem.web.main import create_app
from ffmem.web.worker_client import LiveWorker
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

PROMPT = "The capital of France is Paris."
LAYER, KEY = 1, 4
MAX_TOKENS = 56
pytestmark = pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")
TRY_FIELDS = {
    "text", "max_length", "notice", "notice_field", "tokens", "shaded", "first_mined", "max", "min",
    "max_rank", "min_rank", "positive_of", "negative_of", "top_k",
}  # fmt: skip


@pytest.fixture(scope="module")
def live(tiny, tiny_model_dir):
    live = Live(device="cpu", max_tokens=MAX_TOKENS, queue=4)
    live.models[str(tiny_model_dir)] = tiny
    return live


@pytest.fixture(scope="module")
def worker(live):
    return TestClient(create_live_app(live), base_url="http://worker")


@pytest.fixture(scope="module")
def client(explorer_db, worker):
    settings = Settings(database_url=explorer_db, trace_rate_limit="0")
    app = create_app(settings, live=LiveWorker("http://worker", 30, client=worker))
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


def by_hand(loaded, ids: list[int], layer: int) -> torch.Tensor:
    """Every memory's coefficient at every position, from the weights: the MLP's input x (a plain
    PyTorch hook on the Llama module), then m = silu(x·gᵀ) ⊙ (x·uᵀ). [pos, d_ff]"""
    mlp = loaded.model.model.layers[layer].mlp
    seen = {}
    handle = mlp.register_forward_pre_hook(lambda module, inputs: seen.__setitem__("x", inputs[0][0]))
    try:
        with torch.inference_mode():
            loaded.model(torch.tensor([ids]))
    finally:
        handle.remove()
    x = seen["x"]  # [pos, d]
    with torch.inference_mode():
        gate = x @ mlp.gate_proj.weight.T  # [pos, d_ff]
        up = x @ mlp.up_proj.weight.T  # [pos, d_ff]
        return gate * torch.sigmoid(gate) * up  # silu(gate) · up


def engine_capture(loaded, ids: list[int], layer: int) -> torch.Tensor:
    """ffmem's own capture over a whole forward pass, as mining does: [pos, d_ff]"""
    with torch.inference_mode(), capture(loaded.model, loaded.adapter, [layer], ("coefficients",)) as got:
        loaded.model(torch.tensor([ids]))
    return got.coefficients[layer][0].float()


def test_the_worker_answers_every_token_equal_to_a_hand_computation(worker, tiny, tiny_model_dir):
    blocks = tiny.model.model.layers
    later = []
    handle = blocks[LAYER + 1].register_forward_hook(lambda *args: later.append(1))
    try:
        response = worker.post(
            "/coefficients", json={"model": str(tiny_model_dir), "text": PROMPT, "layer": LAYER, "key": KEY}
        )
    finally:
        handle.remove()
    assert response.status_code == 200
    body = response.json()
    assert set(body) == set(CoefficientsAnswer.model_fields)
    assert CoefficientsAnswer.model_validate(body).model_dump(mode="json") == body
    encoded = tiny.tokenizer(PROMPT, return_offsets_mapping=True)
    ids = encoded.input_ids
    assert body["token_ids"] == ids and (body["layer"], body["key"]) == (LAYER, KEY)
    assert body["tokens"] == [tiny.tokenizer.decode([i]) for i in ids]
    assert body["offsets"] == [list(o) for o in encoded.offset_mapping]
    assert body["first_position"] == 0  # the tiny tokenizer puts no BOS first
    expected = by_hand(tiny, ids, LAYER)[:, KEY]  # [pos]
    assert body["coefficients"] == pytest.approx(expected.tolist(), abs=1e-5)
    assert body["max"] == pytest.approx(float(expected.max()), abs=1e-5)
    assert body["min"] == pytest.approx(float(expected.min()), abs=1e-5)
    assert (body["max_position"], body["min_position"]) == (int(expected.argmax()), int(expected.argmin()))
    assert later == []  # the forward pass stopped after layer 1: layer 2 never ran
    for block in blocks:  # and every hook is gone
        assert not block._forward_hooks and not block.mlp.down_proj._forward_pre_hooks
    last = worker.post(
        "/coefficients", json={"model": str(tiny_model_dir), "text": PROMPT, "layer": 2, "key": 0}
    )
    assert last.json()["coefficients"] == pytest.approx(by_hand(tiny, ids, 2)[:, 0].tolist(), abs=1e-5)
    paths = worker.get("/openapi.json").json()["paths"]
    assert paths["/coefficients"]["post"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CoefficientsAnswer"
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer": 3}, "no memory L3K4 in a 3×48 model"),
        ({"key": 48}, "no memory L1K48 in a 3×48 model"),
        ({"key": -1}, "key: Input should be greater than or equal to 0"),
        ({"text": "  "}, "the prompt is empty: type some text"),
        ({"text": "a " * 60}, f"the prompt has 61 tokens; the limit is {MAX_TOKENS} (max_prompt_tokens)"),
    ],
)
def test_the_worker_refuses_bad_requests_in_the_error_shape(worker, tiny_model_dir, change, message):
    request = {"model": str(tiny_model_dir), "text": PROMPT, "layer": LAYER, "key": KEY} | change
    response = worker.post("/coefficients", json=request)
    assert response.status_code == 400
    field = {"field": "text"} if "text" in change else {}  # the page shows it next to the box
    assert response.json() == {"ok": False, "error": message, "status": 400} | field


def key_url(slug: str, fmt: str = "") -> str:
    return f"/m/{slug}/layers/{LAYER}/keys/{KEY}{fmt}"


def stored(db, run_id: int, sign: int) -> list[float]:
    found = memory_reads.get_triggers(session=db, run_id=run_id, layer=LAYER, key=KEY, sign=sign)
    return [t.coefficient for t in found]


def test_the_json_twin_answers_under_try_text_equal_to_the_engine_capture(client, db, slug, tiny):
    body = client.get(key_url(slug, ".json"), params={"text": PROMPT}).json()
    tried = body["try_text"]
    assert set(tried) == TRY_FIELDS
    encoded = tiny.tokenizer(PROMPT, return_offsets_mapping=True)
    ids = encoded.input_ids
    m = engine_capture(tiny, ids, LAYER)[:, KEY].tolist()  # [pos]
    assert [t["token_id"] for t in tried["tokens"]] == ids
    assert [t["token"] for t in tried["tokens"]] == [tiny.tokenizer.decode([i]) for i in ids]
    shaded = tried["shaded"]
    assert set(shaded) == {"tokens", "scale", "peak", "prefix_end"}
    assert [t["coefficient"] for t in shaded["tokens"]] == pytest.approx(m, abs=1e-5)
    assert "".join(t["text"] for t in shaded["tokens"]) == PROMPT  # the pieces are the text as typed
    assert [t["text"] for t in shaded["tokens"]] == [PROMPT[a:b] for a, b in encoded.offset_mapping]
    run = db.get(Run, body["run"]["id"])
    assert run.provenance["first_position"] is False  # the run mines from 1: so does the comparison
    assert tried["first_mined"] == 1 and tried["top_k"] == run.top_k == 6
    high = max(range(1, len(m)), key=m.__getitem__)
    low = min(range(1, len(m)), key=m.__getitem__)
    assert tried["max"] == {"position": high, "token": tried["tokens"][high]["token"], "coefficient": m[high]}
    assert tried["min"] == {"position": low, "token": tried["tokens"][low]["token"], "coefficient": m[low]}
    assert tried["max"]["coefficient"] == pytest.approx(m[high], abs=1e-5)
    assert shaded["peak"] == high and shaded["prefix_end"] is None
    stats = body["stats"]
    assert shaded["scale"] == max(abs(stats["max_coefficient"]), abs(stats["min_coefficient"]))
    positive, negative = stored(db, run.id, 1), stored(db, run.id, -1)
    assert tried["positive_of"] == len(positive) and tried["negative_of"] == len(negative)
    assert tried["max_rank"] == 1 + sum(c > m[high] for c in positive)
    assert tried["min_rank"] == 1 + sum(c < m[low] for c in negative)
    assert (tried["text"], tried["notice"], tried["notice_field"]) == (PROMPT, None, None)
    plain = client.get(key_url(slug, ".json")).json()["try_text"]  # no text: the box only
    assert plain == {
        "text": None, "max_length": 32 * 512, "notice": None, "notice_field": None, "tokens": [],
        "shaded": None, "first_mined": None, "max": None, "min": None, "max_rank": None, "min_rank": None,
        "positive_of": 0, "negative_of": 0, "top_k": 0,
    }  # fmt: skip


def test_a_stored_trigger_sentence_ranks_where_it_is_stored(client, db, slug, tiny):
    """The top stored trigger's own prefix, tried: its max is the stored coefficient, rank 1."""
    body = client.get(key_url(slug, ".json")).json()
    top = body["triggers"][0]
    tried = client.get(key_url(slug, ".json"), params={"text": top["sentence"]}).json()["try_text"]
    assert tried["max"]["coefficient"] == pytest.approx(top["coefficient"], abs=1e-5)
    assert tried["max"]["position"] == top["position"] and tried["max_rank"] in (1, 2)  # a tie ranks 1
    assert tried["max_rank"] == 1 + sum(
        c > tried["max"]["coefficient"] for c in stored(db, body["run"]["id"], 1)
    )


def test_the_page_shades_the_text_and_escapes_it(client, slug, tiny):
    hostile = 'Paris <script>alert(1)</script> "><img src=x onerror=alert(1)>'
    page = client.get(key_url(slug), params={"text": hostile})
    assert page.status_code == 200
    assert "<script>alert(1)</script>" not in page.text and "<img src=x" not in page.text
    assert 'id="try-text-shaded"' in page.text and 'class="stok' in page.text
    assert "&lt;script&gt;" in page.text
    assert f">{escape(hostile)}</textarea>" in page.text  # the box keeps the text
    assert 'id="triggers"' in page.text  # the rest of the key page as always
    ids = tiny.tokenizer(hostile).input_ids
    m = engine_capture(tiny, ids, LAYER)[:, KEY].tolist()
    answer = page.text[page.text.index('<div id="try_text"') :]
    answer = answer[: answer.index("</div>")]  # other sections shade their sentences too
    shown = [float(v) for v in _attributes(answer, "data-m")]
    assert shown == pytest.approx(m, abs=1e-5)
    assert "it would rank <strong>#" in page.text or "below all" in page.text


def _attributes(html: str, name: str) -> list[str]:
    return re.findall(rf'{name}="([^"]*)"', html)


def test_htmx_swaps_only_the_answer(client, slug):
    headers = {"HX-Request": "true", "HX-Target": "try_text"}
    fragment = client.get(key_url(slug), params={"text": PROMPT}, headers=headers)
    assert fragment.status_code == 200 and "<html" not in fragment.text
    assert fragment.text.lstrip().startswith('<div id="try_text" class="try-answer" data-stale-on-error>')
    assert 'id="try-text-shaded"' in fragment.text and 'id="triggers"' not in fragment.text
    assert 'id="try-text-input"' not in fragment.text  # the box stays as typed
    page = client.get(key_url(slug))
    assert '<section class="try" id="try-box" data-max-query="8192">' in page.text  # longer: POST
    assert 'hx-target="#try_text" hx-swap="outerHTML" hx-push-url="true"' in page.text
    assert 'maxlength="16384"' in page.text and '<div id="try_text" class="try-answer"' in page.text
    assert "try-text-shaded" not in page.text  # no text: the box only


@pytest.mark.parametrize(
    ("text", "message", "field"),
    [
        ("", "The text is empty: type some text.", "text"),
        ("  \n", "The text is empty: type some text.", "text"),
        ("a " * 60, f"The prompt has 61 tokens; the limit is {MAX_TOKENS} (max_prompt_tokens).", "text"),
    ],
)
def test_a_bad_text_is_a_400_shown_next_to_the_box(client, slug, text, message, field):
    response = client.get(key_url(slug, ".json"), params={"text": text})
    assert response.status_code == 400
    assert response.json() == {"ok": False, "error": message, "status": 400}
    page = client.get(key_url(slug), params={"text": text})
    assert page.status_code == 400 and 'id="triggers"' in page.text  # the key page, whole
    if field:
        assert f'<span class="field-error" id="text-error" role="alert">{escape(message)}</span>' in page.text
        fragment = client.get(
            key_url(slug), params={"text": text}, headers={"HX-Request": "true", "HX-Target": "try_text"}
        )
        assert fragment.status_code == 400 and fragment.headers["x-error-field"] == "text"
        assert str(escape(message)) in fragment.text and "<html" not in fragment.text
    else:
        assert (
            f'id="try-text-notice" role="status"><strong>No answer</strong> — Bad request: {escape(message)}'
            in page.text
        )


def test_a_huge_text_is_refused_before_the_worker(explorer_db, slug):
    app = create_app(
        Settings(database_url=explorer_db, max_query_bytes=100_000, worker_url="http://127.0.0.1:9")
    )
    with TestClient(app) as roomy:
        response = roomy.get(key_url(slug, ".json"), params={"text": "a" * 20000})
    app.state.engine.dispose()
    assert response.status_code == 400
    assert response.json() == {"ok": False, "error": "Texts are limited to 512 tokens.", "status": 400}


def test_a_down_worker_leaves_the_key_page_whole(explorer_db, slug):
    app = create_app(Settings(database_url=explorer_db, worker_url="http://127.0.0.1:9"))
    with TestClient(app) as client:
        response = client.get(key_url(slug, ".json"), params={"text": PROMPT})
        assert response.status_code == 503 and response.headers["retry-after"] == "5"
        assert response.json()["error"].startswith("No live worker answers at http://127.0.0.1:9")
        page = client.get(key_url(slug), params={"text": PROMPT})
        assert page.status_code == 503 and page.headers["retry-after"] == "5"
        assert 'id="triggers"' in page.text and 'id="try-text-input"' in page.text
        assert "<strong>No answer</strong> — Live worker unavailable: No live worker answers" in page.text
        fragment = client.get(
            key_url(slug), params={"text": PROMPT}, headers={"HX-Request": "true", "HX-Target": "try_text"}
        )
        assert fragment.status_code == 503 and "<html" not in fragment.text
        assert "Live worker unavailable" in fragment.text
        assert client.get(key_url(slug)).status_code == 200  # without a text, no worker asked
        assert client.get(key_url(slug, ".json")).status_code == 200
    app.state.engine.dispose()


def test_only_a_text_spends_the_live_budget(explorer_db, worker, slug):
    settings = Settings(database_url=explorer_db, trace_rate_limit="1/minute")
    app = create_app(settings, live=LiveWorker("http://worker", 30, client=worker))
    with TestClient(app) as client:
        for _ in range(3):
            assert client.get(key_url(slug)).status_code == 200  # browsing: never limited
        assert client.get(key_url(slug, ".json"), params={"text": PROMPT}).status_code == 200
        refused = client.get(key_url(slug, ".json"), params={"text": PROMPT})
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"].startswith("Live traces and tests are limited to 1 per minute")
        page = client.get(key_url(slug), params={"text": PROMPT})
        assert page.status_code == 429 and 'id="triggers"' in page.text
        assert "<strong>No answer</strong> — Too many live requests" in page.text
        assert client.get(key_url(slug)).status_code == 200
    app.state.engine.dispose()
