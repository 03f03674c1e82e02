"""Token search past the stored depth (issue 41, item 4), on the tiny index (SQLite and Postgres) with a real
live worker (its ASGI app in-process): the worker's ranking equals a brute force written here (E·Vᵀ with
torch, the model's own modules, nothing of ffmem.engine), its first 32 equal the run's token → memories
table, the search merges them to the limit and says so (`depth`); without a worker, or when it fails or is
slow, the search shows the stored 32 and says why; limits past the protocol's are refused in the one error
shape by the web and the worker alike."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from explorer_index import NO_WORKER, tiny_worker
from fastapi.testclient import TestClient
from sqlalchemy import select

from ffmem.config import Settings
from ffmem.engine.live.protocol import MAX_SEARCH_MEMORIES, MAX_SEARCH_TOKENS
from ffmem.engine.live.token_search import strongest
from ffmem.store.models import LanguageModel, Token
from ffmem.web.main import create_app
from ffmem.web.token_search import rank_memories
from ffmem.web.worker_client import START, LiveWorker
from ffmem.worker.live_executor import Live

pytestmark = [
    pytest.mark.backends("sqlite", "postgres"),
    pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument"),
]
STORED = 32  # the tiny index's token → memories depth (Settings.token_memories)


class Wire:
    """The live worker's HTTP client, keeping each POST's path and JSON body."""

    def __init__(self, client) -> None:
        self.client, self.sent = client, []

    def post(self, path: str, **kwargs):
        self.sent.append(path)
        return self.client.post(path, **kwargs)

    def get(self, path: str, **kwargs):
        return self.client.get(path, **kwargs)


@pytest.fixture(scope="module")
def live_worker(tiny, tiny_model_dir) -> tuple[Live, TestClient]:
    return tiny_worker(tiny, tiny_model_dir)


@pytest.fixture(scope="module")
def live(live_worker) -> Live:
    return live_worker[0]


@pytest.fixture(scope="module")
def worker(live_worker) -> TestClient:
    return live_worker[1]


@pytest.fixture(scope="module")
def wire(worker) -> Wire:
    return Wire(worker)


def _app(explorer_db, live: LiveWorker | None = None, **settings):
    return create_app(Settings(database_url=explorer_db, **settings), live=live)


@pytest.fixture(scope="module")
def client(explorer_db, wire):
    app = _app(explorer_db, LiveWorker("http://worker", 30, client=wire))
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


@pytest.fixture(scope="module")
def model(db) -> LanguageModel:
    return db.scalars(select(LanguageModel)).one()


@pytest.fixture(scope="module")
def word(db, model) -> tuple[str, list[int]]:
    """A word typed without a space that is a token both as typed and with one: two tokens, 288 pairs."""
    texts = dict(db.execute(select(Token.text, Token.token_id).where(Token.model_id == model.id)).all())
    for text, token_id in sorted(texts.items()):
        if text.isalpha() and len(text) > 1 and " " + text in texts:
            return text, sorted([token_id, texts[" " + text]])
    raise AssertionError("the tiny vocabulary has no such word")


@pytest.fixture(scope="module")
def by_hand(tiny) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """readout → (every value's logits over the whole vocabulary [memories, vocab], their log Z [memories]),
    written out from the Llama's own modules: values are down_proj's columns, E the lm_head."""
    llama = tiny.model
    values = torch.cat([layer.mlp.down_proj.weight.T for layer in llama.model.layers])  # [memories, d]
    head = llama.lm_head  # E: [vocab, d]
    with torch.no_grad():
        raw = values @ head.weight.T  # [memories, vocab]
        norm = head(llama.model.norm(values))  # [memories, vocab]
    return {r: (logits, torch.logsumexp(logits, dim=-1)) for r, logits in (("raw", raw), ("norm", norm))}


def _brute_force(by_hand, readout: str, by: str, tokens: list[int], direction: int, n: int) -> list[tuple]:
    """The n strongest (memory, token, score) over every pair, equal scores by memory, then token."""
    logits, log_z = by_hand[readout]
    scores = logits[:, tokens] - (log_z[:, None] if by == "prob" else 0)  # [memories, tokens]
    pairs = [
        (-direction * float(scores[m, t]), m, tokens[t])
        for m in range(scores.shape[0])
        for t in range(len(tokens))
    ]
    return [(m, token, -direction * s) for s, m, token in sorted(pairs)[:n]]


@pytest.mark.parametrize(
    ("readout", "by"), [("raw", "logit"), ("raw", "prob"), ("norm", "prob"), ("norm", "logit")]
)
def test_a_search_for_200_returns_200_equal_to_brute_force(
    client, wire, slug, word, tiny, by_hand, readout, by
):
    text, tokens = word
    sent = len(wire.sent)
    body = client.get(
        f"/m/{slug}/search.json", params={"q": text, "readout": readout, "by": by, "limit": 200}
    ).json()
    assert body["token_ids"] == tokens and body["token_coverage"] == "full"
    assert body["depth"] == {"stored": STORED, "source": "live", "reason": None}
    assert wire.sent[sent:] == ["/token-memories"], "one request to the worker"
    logits, log_z = by_hand[readout]
    for direction, name in ((1, "promote"), (-1, "suppress")):
        shown = body[name]
        expected = _brute_force(by_hand, readout, by, tokens, direction, 200)
        assert len(shown) == 200
        assert [(m["layer"] * tiny.n_keys + m["key"], m["token_id"]) for m in shown] == [
            (m, t) for m, t, _ in expected
        ]
        for m in shown:
            i = m["layer"] * tiny.n_keys + m["key"]
            assert m["direction"] == direction
            assert m["logit"] == pytest.approx(float(logits[i, m["token_id"]]), rel=1e-5, abs=1e-5)
            assert m["prob"] == pytest.approx(float((logits[i, m["token_id"]] - log_z[i]).exp()), rel=1e-4)


@pytest.mark.parametrize(("readout", "by"), [("raw", "prob"), ("norm", "logit")])
def test_the_workers_first_32_are_the_stored_tables(worker, db, run, model, word, readout, by):
    _, tokens = word
    asked = {"model": model.source, "token_ids": tokens, "readout": readout, "by": by, "limit": 200}
    answer = worker.post("/token-memories", json=asked)
    assert answer.status_code == 200, answer.text
    answer = answer.json()
    assert answer["memories"] == model.n_layers * model.n_keys == 144
    table = rank_memories(db, model, run, tokens, readout=readout, by=by, limit=200)
    assert table.depth.stored == STORED and table.depth.reason == "No live worker is configured."
    for name, hits in (("promote", table.promote), ("suppress", table.suppress)):
        live = answer[name]
        assert len(live) == 200 and len(hits) == STORED
        assert [(p["layer"], p["key"], p["token_id"]) for p in live[:STORED]] == [
            (h.layer, h.key, h.token_id) for h in hits
        ]
        stored_scores = [h.logit if by == "logit" else np.log(h.prob) for h in hits]
        assert [p["score"] for p in live[:STORED]] == pytest.approx(stored_scores, rel=1e-5, abs=1e-5)
        assert len({(p["layer"], p["key"], p["token_id"]) for p in live}) == 200, "each pair once"


def test_a_search_within_the_stored_depth_asks_no_worker(client, wire, slug, word):
    text, _ = word
    sent = len(wire.sent)
    body = client.get(f"/m/{slug}/search.json", params={"q": text, "limit": STORED}).json()
    assert len(body["promote"]) == len(body["suppress"]) == STORED
    assert body["depth"] == {"stored": STORED, "source": "stored", "reason": None}
    assert wire.sent[sent:] == []


def _failing(handler) -> LiveWorker:
    """A LiveWorker whose every request is answered (or raised) by `handler`."""
    transport = httpx.MockTransport(handler)
    return LiveWorker("http://broken", 30, client=httpx.Client(base_url="http://broken", transport=transport))


def _timeout(request):
    raise httpx.ReadTimeout("slow", request=request)


@pytest.mark.parametrize(
    ("worker_answer", "reason"),
    [
        (None, f"No live worker answers at {NO_WORKER} (ConnectError). {START}"),
        (_timeout, "The live worker did not answer in time (10 s, search_worker_timeout)."),
        (
            lambda request: httpx.Response(
                503, json={"ok": False, "error": "the live worker is busy", "status": 503}
            ),
            "The live worker is busy.",
        ),
        (
            lambda request: httpx.Response(
                500, json={"ok": False, "error": "it <b>broke</b>", "status": 500}
            ),
            "It <b>broke</b>.",
        ),
        (lambda request: httpx.Response(200, json={"memories": 7}), None),
    ],
    ids=["down", "slow", "busy", "failed", "another version"],
)
def test_without_a_worker_the_search_shows_the_stored_32_and_says_why(
    explorer_db, slug, word, worker_answer, reason
):
    live = None if worker_answer is None else _failing(worker_answer)
    app = _app(explorer_db, live, worker_url=NO_WORKER)
    text, _ = word
    with TestClient(app) as client:
        body = client.get(f"/m/{slug}/search.json", params={"q": text, "limit": 200}).json()
        page = client.get(f"/m/{slug}/search", params={"q": text, "limit": 200}).text
    app.state.engine.dispose()
    if reason is None:  # an answer this explorer cannot read
        reason = (
            "The live worker at http://broken answered a TokenMemoriesAnswer this explorer cannot read "
            "(promote: Field required); run the same ffmem version on both."
        )
    assert body["depth"] == {"stored": STORED, "source": "stored", "reason": reason}
    assert len(body["promote"]) == len(body["suppress"]) == STORED
    notice = f"Showing the stored 32 each way, not 200: {reason}".replace("<", "&lt;").replace(">", "&gt;")
    assert f'<p class="notice" id="token-depth" role="status">{notice}</p>' in page.replace("&#39;", "'")
    assert "<b>broke</b>" not in page


def test_the_search_page_shows_the_live_depth_and_its_limit_box(client, slug, word):
    text, _ = word
    page = client.get(f"/m/{slug}/search", params={"q": text, "limit": 200}).text
    assert (
        "the 32 strongest each way are stored per token, the rest up to 200 come from the live worker" in page
    )
    assert 'id="token-depth"' not in page
    assert '<input id="limit" type="number" name="limit" value="200" min="1" max="200"' in page
    assert page.count('<tr><td class="num">') == 2 * 200, "200 memories each way"


@pytest.mark.parametrize("limit", [0, MAX_SEARCH_MEMORIES + 1, "many"])
def test_the_web_and_the_worker_refuse_a_limit_past_the_protocols_alike(
    client, worker, slug, model, word, limit
):
    text, tokens = word
    web = client.get(f"/m/{slug}/search.json", params={"q": text, "limit": limit})
    direct = worker.post("/token-memories", json={"model": model.source, "token_ids": tokens, "limit": limit})
    message = {
        0: "limit: Input should be greater than or equal to 1",
        MAX_SEARCH_MEMORIES + 1: "limit: Input should be less than or equal to 200",
        "many": "limit: Input should be a valid integer, unable to parse string as an integer",
    }[limit]
    assert (web.status_code, web.json()) == (400, {"ok": False, "error": message, "status": 400})
    assert (direct.status_code, direct.json()) == (400, {"ok": False, "error": message, "status": 400})
    html = client.get(f"/m/{slug}/search", params={"q": text, "limit": limit})
    assert html.status_code == 400 and message in html.text


def test_the_worker_refuses_bad_tokens_in_its_error_shape(worker, model, tiny):
    vocab = tiny.model.lm_head.weight.shape[0]
    ask = {"model": model.source, "limit": 5}
    past = worker.post("/token-memories", json=ask | {"token_ids": [3, vocab]})
    assert (past.status_code, past.json()) == (
        400,
        {"ok": False, "error": f"token ids must lie in 0–{vocab - 1}", "status": 400, "field": "token_ids"},
    )
    many = worker.post("/token-memories", json=ask | {"token_ids": list(range(MAX_SEARCH_TOKENS + 1))})
    assert (many.status_code, many.json()) == (
        400,
        {
            "ok": False,
            "error": f"token_ids: List should have at most {MAX_SEARCH_TOKENS} items after validation, "
            f"not {MAX_SEARCH_TOKENS + 1}",
            "status": 400,
        },
    )
    none = worker.post("/token-memories", json=ask | {"token_ids": []})
    assert none.json()["error"] == "token_ids: List should have at least 1 item after validation, not 0"
    negative = worker.post("/token-memories", json=ask | {"token_ids": [-1]})
    assert negative.json()["error"] == "token_ids.0: Input should be greater than or equal to 0"


def test_the_worker_keeps_each_readouts_log_z_and_the_norms_scales(worker, live, model, word, by_hand):
    _, tokens = word
    live.kept.clear()
    for by in ("logit", "prob", "prob"):
        worker.post(
            "/token-memories", json={"model": model.source, "token_ids": tokens, "by": by, "limit": 3}
        )
    assert set(live.kept) == {(model.source, "log_z raw")}, (
        "computed once, by the first search by probability"
    )
    np.testing.assert_allclose(
        live.kept[model.source, "log_z raw"].numpy(), by_hand["raw"][1].numpy(), rtol=1e-6
    )
    ask = {"model": model.source, "token_ids": tokens, "readout": "norm", "by": "logit", "limit": 3}
    worker.post("/token-memories", json=ask)
    assert set(live.kept) == {(model.source, "log_z raw"), (model.source, "scales")}


def test_equal_scores_rank_by_memory_then_token():
    scores = torch.tensor([[1.0, 3.0], [3.0, 2.0], [3.0, 3.0], [0.0, 1.0]])  # [memories, tokens]
    assert strongest(scores, 1, 4) == [(0, 1, 3.0), (1, 0, 3.0), (2, 0, 3.0), (2, 1, 3.0)]
    assert strongest(scores, -1, 3) == [(3, 0, 0.0), (0, 0, 1.0), (3, 1, 1.0)]
    assert strongest(scores, 1, 100)[-1] == (3, 0, 0.0) and len(strongest(scores, 1, 100)) == 8
