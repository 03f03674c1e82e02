"""What this memory does (TokenChange) through the web app and a real live worker (its ASGI app in-process),
on the tiny index: the exact JSON fields, every number against a recomputation written here (the whole prefix
through Hugging Face's forward with a plain hook on the down projection, the memory scaled at the last token
only), the control memory, your own text, bad input as a 400 in the error shape, the fragment and the key
page's link."""

from __future__ import annotations

import statistics

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import select
from tiny_models import scaled_log_p

from ffmem.config import Settings
from ffmem.store import memory_reads, token_changes, vocabularies
from ffmem.store.models import Run, Sentence
from ffmem.web.main import create_app
from ffmem.web.worker_client import LiveWorker
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

pytestmark = pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")
FIELDS = {
    "page", "title", "model", "layer", "key", "run", "text", "contexts", "factor", "measured", "promoted",
    "suppressed", "vocab_proj", "score", "control", "control_url", "share_url",
}  # fmt: skip


@pytest.fixture(scope="module")
def client(explorer_db, tiny, tiny_model_dir):
    live = Live(device="cpu", max_tokens=56, queue=4)
    live.models[str(tiny_model_dir)] = tiny
    worker = TestClient(create_live_app(live), base_url="http://worker")
    settings = Settings(database_url=explorer_db, trace_rate_limit="0")
    app = create_app(settings, live=LiveWorker("http://worker", 30, client=worker))
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = (x.double().argsort().argsort().double() for x in (a, b))
    n = len(a)
    return float(1 - 6 * ((ra - rb) ** 2).sum() / (n * (n**2 - 1)))


def _expected(tiny, prefixes, layer, key, factor):
    change = sum(
        scaled_log_p(tiny, p, layer, key, factor) - scaled_log_p(tiny, p, layer, key, 0.0) for p in prefixes
    )
    return change / len(prefixes)  # [vocab]


def _value_logits(tiny, layer, key) -> torch.Tensor:
    v = tiny.model.model.layers[layer].mlp.down_proj.weight[:, key].detach()  # [d]
    return (tiny.model.lm_head.weight.detach() @ v).float()  # [vocab]: v·E


def test_what_a_memory_does_on_its_top_triggers(client, db, slug, tiny):
    body = client.get(f"/m/{slug}/layers/1/keys/4/token-change.json", params={"contexts": 3}).json()
    assert set(body) == FIELDS and body["page"] == "token_change"
    assert (body["layer"], body["key"], body["contexts"], body["factor"], body["text"]) == (
        1,
        4,
        3,
        2.0,
        None,
    )
    run_id = body["run"]
    triggers = memory_reads.get_triggers(session=db, run_id=run_id, layer=1, key=4, sign=1, limit=3)
    corpus = db.get(Run, run_id).corpus_id
    prefixes = [db.get(Sentence, (corpus, t.sentence_index)).token_ids[: t.position + 1] for t in triggers]
    assert [m["coefficient"] for m in body["measured"]] == pytest.approx(
        [t.coefficient for t in triggers], abs=1e-4
    )
    change = _expected(tiny, prefixes, 1, 4, 2.0)
    promoted = change.topk(10)
    assert [s["token"]["token_id"] for s in body["promoted"]] == promoted.indices.tolist()
    assert [s["change"] for s in body["promoted"]] == pytest.approx(promoted.values.tolist(), abs=1e-4)
    assert [s["token"]["token_id"] for s in body["suppressed"]] == change.topk(
        10, largest=False
    ).indices.tolist()
    top = body["promoted"][0]
    p = [
        [scaled_log_p(tiny, q, 1, 4, s)[top["token"]["token_id"]].exp() for q in prefixes]
        for s in (1.0, 2.0, 0.0)
    ]
    assert (top["base"], top["amplified"], top["off"]) == pytest.approx(
        [float(sum(x)) / 3 for x in p], abs=1e-5
    )
    for name, key in (("score", 4), ("control", 28)):  # the control: the key half a layer away
        logits = _value_logits(tiny, 1, key)
        shared = set(promoted.indices.tolist()) & set(logits.topk(10).indices.tolist())
        assert body[name] == {
            "key": key,
            "overlap": len(shared) / 10,
            "spearman": pytest.approx(_spearman(change, logits), abs=1e-3),
        }
    assert [t["token_id"] for t in body["vocab_proj"]] == _value_logits(tiny, 1, 4).topk(10).indices.tolist()
    assert body["control_url"] == f"/m/{slug}/layers/1/keys/28?run={run_id}"
    assert body["share_url"] == f"/m/{slug}/layers/1/keys/4/token-change?run={run_id}&contexts=3"


def test_what_a_memory_does_on_your_text(client, slug, tiny):
    text = "The capital of France is Paris, a city on the Seine"
    body = client.get(
        f"/m/{slug}/layers/2/keys/9/token-change.json", params={"text": text, "contexts": 2, "factor": 4}
    ).json()
    ids = tiny.tokenizer(text).input_ids
    with torch.inference_mode():
        captured = {}
        handle = tiny.model.model.layers[2].mlp.down_proj.register_forward_pre_hook(
            lambda module, inputs: captured.update(m=inputs[0][0, :, 9].clone())
        )
        tiny.model(torch.tensor([ids]))
        handle.remove()
    m = captured["m"]  # [pos]
    top = sorted(int(i) for i in m.argsort(descending=True)[:2])
    assert all(m[i] > 0 for i in top)
    prefixes = [ids[: i + 1] for i in top]
    assert [c["coefficient"] for c in body["measured"]] == pytest.approx([float(m[i]) for i in top], abs=1e-4)
    change = _expected(tiny, prefixes, 2, 9, 4.0)
    assert [s["token"]["token_id"] for s in body["promoted"]] == change.topk(10).indices.tolist()
    assert body["text"] == text and body["factor"] == 4.0
    assert "text=The+capital" in body["share_url"] and "factor=4.0" in body["share_url"]


@pytest.mark.parametrize(
    ("params", "status", "says"),
    [
        ({"factor": 1}, 400, "factor"),
        ({"factor": 1000}, 400, "factor"),
        ({"contexts": 0}, 400, "contexts"),
        ({"contexts": 65}, 400, "contexts"),
        ({"text": "   "}, 400, "empty"),
    ],
)
def test_bad_input_is_a_400_in_the_error_shape(client, slug, params, status, says):
    response = client.get(f"/m/{slug}/layers/1/keys/4/token-change.json", params=params)
    body = response.json()
    assert response.status_code == status and body["ok"] is False and body["status"] == status
    assert says in body["error"] or says in body.get("detail", "") or says in str(body)


def test_the_page_renders_at_once_and_the_fragment_holds_the_result(client, slug):
    page = client.get(f"/m/{slug}/layers/1/keys/4/token-change", params={"text": "<b>x</b> Paris"})
    assert page.status_code == 200 and 'hx-trigger="load"' in page.text and "<b>x</b>" not in page.text
    fragment = client.get(
        f"/m/{slug}/layers/1/keys/4/token-change",
        params={"contexts": 2},
        headers={"HX-Request": "true", "HX-Target": "token_change"},
    )
    assert fragment.status_code == 200 and "<html" not in fragment.text
    assert 'id="token-change-overlap"' in fragment.text and "control" in fragment.text
    key_page = client.get(f"/m/{slug}/layers/1/keys/4").text
    assert f'hx-get="/m/{slug}/layers/1/keys/4/token-change"' in key_page
    assert f'href="/m/{slug}/layers/1/keys/4/token-change?run=' in key_page  # its own page


def test_the_worker_refuses_a_text_where_the_key_never_fires(client, db, slug, tiny, tiny_model_dir):
    live = Live(device="cpu", max_tokens=56, queue=4)
    live.models[str(tiny_model_dir)] = tiny
    worker = TestClient(create_live_app(live))
    text = "Mozart"
    ids = tiny.tokenizer(text).input_ids
    with torch.inference_mode():
        captured = {}
        handle = tiny.model.model.layers[0].mlp.down_proj.register_forward_pre_hook(
            lambda module, inputs: captured.update(m=inputs[0][0].clone())
        )
        tiny.model(torch.tensor([ids]))
        handle.remove()
    never = int((captured["m"] <= 0).all(dim=0).nonzero()[0])  # a key with m ≤ 0 at every token
    source = db.scalars(select(Run)).first().model.source
    answer = worker.post("/token-change", json={"model": source, "layer": 0, "key": never, "text": text})
    assert answer.status_code == 400
    assert answer.json() == {
        "ok": False,
        "error": "the key never fires (m > 0) on this text: try another",
        "status": 400,
        "field": "text",
    }


def test_the_runs_sample_shows_on_the_key_and_model_pages(client, db, slug):
    """The tiny index stores every memory in its sample (144 ≤ token_change_memories): the key page's JSON
    twin names the stored row's tokens, the model page the medians per depth third of the stored rows."""
    run_id = db.scalars(select(Run.id)).one()
    rows = token_changes.token_changes(session=db, run_id=run_id)
    assert rows and all(r.control_key == (r.key + 24) % 48 for r in rows)
    row = next(r for r in rows if (r.layer, r.key) == (1, 4))
    shown = client.get(f"/m/{slug}/layers/1/keys/4.json").json()["token_change"]
    texts = vocabularies.vocabulary(session=db, model_id=db.get(Run, run_id).model_id)
    assert shown == {
        "contexts": row.contexts,
        "promoted": [{"token_id": i, "token": texts[i]} for i in row.promoted],
        "suppressed": [{"token_id": i, "token": texts[i]} for i in row.suppressed],
        "overlap": row.overlap,
        "spearman": row.spearman,
        "control_key": row.control_key,
        "control_overlap": row.control_overlap,
        "control_spearman": row.control_spearman,
    }
    thirds = client.get(f"/m/{slug}.json").json()["token_change"]
    assert [t["third"] for t in thirds] == ["lower", "middle", "upper"]
    for third, layer in zip(thirds, (0, 1, 2), strict=True):  # three layers: a layer a third
        inside = [r for r in rows if r.layer == layer]
        assert third["memories"] == len(inside)
        assert third["overlap"] == statistics.median(r.overlap for r in inside)
        assert third["control_spearman"] == pytest.approx(
            statistics.median(r.control_spearman for r in inside)
        )
    page = client.get(f"/m/{slug}").text
    assert 'id="token-change-thirds"' in page
