"""Finding memories on the tiny index (SQLite and Postgres), against computations written out here:
full-vocabulary token search equals a brute-force ranking of every value's readout, the stored ranks
are the value tokens', an older run without a token → memories table falls back to the stored tokens;
free-text search shows each sentence once with the matches marked (escaped); the key page's neighbours
equal a brute-force cosine over all memories; the worker stored what each needs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from explorer_index import HOSTILE
from sqlalchemy import delete, func, insert, select, update

from ffmem.engine.relations.neighbours import BASELINE_PAIRS, baseline_pairs
from ffmem.engine.values.projection import value_logits
from ffmem.store import memory_reads
from ffmem.store.models import LanguageModel, NeighbourBaseline, Neighbours, Sentence, Token, TokenMemoryList
from ffmem.web.lookups import model_or_404
from ffmem.web.pages import search
from ffmem.web.routes.search import MAX_LENGTH
from ffmem.web.token_search import rank_memories

# Both backends: each backend has its own text index (FTS5, pg_trgm) and token search.
pytestmark = pytest.mark.backends("sqlite", "postgres")


@pytest.fixture(scope="module")
def direct(tiny) -> dict[str, np.ndarray]:
    """Every value's readout over the whole vocabulary, straight from the model: [layers · keys, vocab]."""
    blocks = tiny.adapter.blocks(tiny.model)
    values = torch.cat([tiny.adapter.value_matrix(b) for b in blocks])
    with torch.no_grad():
        return {readout: value_logits(tiny, values, readout).float().numpy() for readout in ("raw", "norm")}


def _get(client, url: str, status: int = 200) -> dict:
    response = client.get(url)
    assert response.status_code == status, response.text
    return response.json()


def _word(db, run) -> tuple[int, str]:
    """A token with a leading space whose text without it is no token (so q means one token)."""
    texts = dict(db.execute(select(Token.token_id, Token.text).where(Token.model_id == run.model_id)).all())
    known = set(texts.values())
    for token_id, text in sorted(texts.items()):
        if text.startswith(" ") and text[1:].isalpha() and len(text) > 3 and text[1:] not in known:
            return token_id, text
    raise AssertionError("the tiny vocabulary has no such token")


@pytest.mark.parametrize(("readout", "by"), [("raw", "logit"), ("raw", "prob"), ("norm", "prob")])
def test_token_search_ranks_every_memory_as_brute_force(client, db, run, slug, direct, tiny, readout, by):
    token_id, text = _word(db, run)
    body = _get(client, f"/m/{slug}/search.json?q=%20{text[1:]}&readout={readout}&by={by}&limit=30")
    assert body["token_ids"] == [token_id] and body["token_coverage"] == "full"
    logits = direct[readout][:, token_id]  # [memories]
    log_z = torch.logsumexp(torch.from_numpy(direct[readout]), dim=-1).numpy()
    scores = logits if by == "logit" else logits - log_z
    assert body["memories"] == len(scores) == tiny.n_layers * tiny.n_keys
    tolerance = float(1e-5 * np.abs(direct[readout]).max())  # float32 logits, computed apart
    for direction, name in ((1, "promote"), (-1, "suppress")):
        shown = body[name]
        assert len(shown) == 30
        best = np.sort(direction * scores)[::-1][:30]  # the brute-force ranking's scores
        own = np.array([direction * scores[m["layer"] * tiny.n_keys + m["key"]] for m in shown])
        assert np.abs(own - best).max() < tolerance, "each place holds a memory as strong as brute force's"
        for m in shown:
            i = m["layer"] * tiny.n_keys + m["key"]
            assert m["direction"] == direction and m["token"] == text and m["token_id"] == token_id
            assert m["logit"] == pytest.approx(logits[i], abs=tolerance)
            assert m["prob"] == pytest.approx(np.exp(logits[i] - log_z[i]), rel=1e-4)
            true_rank = int((direction * direct[readout][i] > direction * logits[i]).sum())
            if m["rank"] is None:  # not among the stored top / bottom n: beyond them
                assert true_rank >= run.n_value_tokens - 1
            else:
                listed = memory_reads.get_value_tokens(
                    session=db,
                    run_id=run.id,
                    layer=m["layer"],
                    key=m["key"],
                    readout=readout,
                    direction=direction,
                )
                (stored,) = [v.rank for v in listed if v.token_id == token_id]
                assert m["rank"] == stored and abs(m["rank"] - true_rank) <= 1


@pytest.mark.parametrize("by", ["logit", "prob"])
def test_several_tokens_rank_as_one_brute_force_over_every_pair(db, run, slug, direct, tiny, by):
    """A text means several tokens (as typed, with a space): their pairs with every memory are ranked
    together, equal scores by memory, then token; at most the table's depth each way."""
    model = db.scalar(select(LanguageModel).where(LanguageModel.slug == slug))
    tokens = [5, 17, direct["raw"].shape[1] - 1]  # the last token of the vocabulary too
    ranked = rank_memories(db, model, run, tokens, readout="raw", by=by, limit=1000)
    logits = direct["raw"][:, tokens]  # [memories, tokens]
    log_z = torch.logsumexp(torch.from_numpy(direct["raw"]), dim=-1).numpy()[:, None]  # [memories, 1]
    scores = logits if by == "logit" else logits - log_z
    assert ranked.depth.stored == 32 and ranked.memories == tiny.n_layers * tiny.n_keys
    for direction, hits in ((1, ranked.promote), (-1, ranked.suppress)):
        assert len(hits) == 32, "no more than each token's depth, though the limit is higher"
        pairs = sorted(
            (
                (-direction * scores[m, t], m, tokens[t])
                for m in range(scores.shape[0])
                for t in range(len(tokens))
            ),
        )[:32]  # the brute force over every (memory, token) pair
        got = [(h.layer * tiny.n_keys + h.key, h.token_id) for h in hits]
        assert got == [(m, t) for _, m, t in pairs]
        for h in hits:
            m, t = h.layer * tiny.n_keys + h.key, tokens.index(h.token_id)
            assert h.logit == pytest.approx(logits[m, t], rel=1e-4, abs=1e-5)
            assert h.prob == pytest.approx(np.exp(logits[m, t] - log_z[m, 0]), rel=1e-4)


def test_token_search_page_names_its_readout(client, db, run, slug):
    _, text = _word(db, run)
    page = client.get(f"/m/{slug}/search?q=%20{text[1:]}&readout=norm").text
    assert 'id="token-coverage"' in page and "<strong>norm</strong> readout" in page
    assert "lm_head(final_norm(v))" in page and "All 144 memories" in page


def test_a_run_without_a_token_table_searches_its_stored_tokens(db, run, slug):
    token_id, text = _word(db, run)
    db.execute(delete(TokenMemoryList).where(TokenMemoryList.run_id == run.id))  # as a run stored before 0018
    try:
        found = search.search_page(
            db, model_or_404(db, slug), q=text, pinned=None, readout="raw", by="prob", limit=200,
            max_length=MAX_LENGTH,
        )  # fmt: skip
    finally:
        db.rollback()
    assert found.token_coverage == "stored" and found.memories == 0
    for direction, shown in ((1, found.promote), (-1, found.suppress)):
        rows = [
            v
            for v in memory_reads.iter_value_tokens(session=db, run_id=run.id)
            if (v.readout, v.direction, v.token_id) == ("raw", direction, token_id)
        ]
        expected = sorted(rows, key=lambda v: (-direction * v.prob, v.layer, v.key))
        assert [(m.layer, m.key, m.rank) for m in shown] == [(v.layer, v.key, v.rank) for v in expected]


def test_text_search_shows_each_sentence_once_with_the_matches_marked(client, db, run, slug):
    body = _get(client, f"/m/{slug}/search.json?q=capital%20OF&limit=200")
    assert body["sentences"], "the corpus has 'The capital of France is Paris.' (twice)"
    texts = ["".join(p["text"] for p in s["parts"]) for s in body["sentences"]]
    assert len(texts) == len(set(texts)), "one row per sentence (the corpus holds each twice: one row)"
    expected: dict[str, set] = {}  # every positive trigger whose prefix reaches past the text, by sentence
    copies: dict[str, list[int]] = {}
    sentences = {s.index: s for s in db.scalars(select(Sentence).where(Sentence.corpus_id == run.corpus_id))}
    positive = [t for t in memory_reads.iter_triggers(session=db, run_id=run.id) if t.sign == 1]
    for t in positive:
        sentence = sentences[t.sentence_index]
        if "capital of" in sentence.text[: sentence.offsets[t.position][1]].lower():
            expected.setdefault(sentence.text, set()).add((t.layer, t.key, t.position))
            copies.setdefault(sentence.text, [])
            copies[sentence.text] = sorted(set(copies[sentence.text]) | {t.sentence_index})
    assert set(texts) == set(expected)
    strongest = []
    for text, s in zip(texts, body["sentences"], strict=True):
        assert s["sentence_indices"] == copies[text] and all(sentences[i].text == text for i in copies[text])
        assert [p["text"].lower() for p in s["parts"] if p["marked"]] == ["capital of"]
        shown = [(k["layer"], k["key"], k["position"]) for k in s["keys"]]
        assert len(shown) == len(set(shown)) and set(shown) == expected[text]
        coefficients = [k["coefficient"] for k in s["keys"]]
        assert coefficients == sorted(coefficients, reverse=True)
        strongest.append(coefficients[0])
        assert all(
            k["url"] == f"/m/{slug}/layers/{k['layer']}/keys/{k['key']}?run={run.id}" for k in s["keys"]
        )
    assert strongest == sorted(strongest, reverse=True), "the sentence of the strongest trigger first"
    reaching = sorted(  # every trigger whose prefix reaches past the text, the strongest first
        (-t.coefficient, t.layer, t.key, t.position)
        for t in positive
        if "capital of"
        in sentences[t.sentence_index].text[: sentences[t.sentence_index].offsets[t.position][1]].lower()
    )
    few = _get(client, f"/m/{slug}/search.json?q=capital%20OF&limit=5")["sentences"]
    shown = {(k["layer"], k["key"], k["position"]) for s in few for k in s["keys"]}
    assert shown == {(layer, key, position) for _, layer, key, position in reaching[:5]}, "the 5 strongest"
    page = client.get(f"/m/{slug}/search?q=capital%20OF").text
    assert page.count("<mark>capital of</mark>") == len(body["sentences"])


def test_text_search_marks_every_occurrence_and_escapes_the_rest(client, slug):
    body = _get(client, f"/m/{slug}/search.json?q=on")
    assert any(sum(p["marked"] for p in s["parts"]) >= 2 for s in body["sentences"]), "'Seine, famous … on'"
    page = client.get(f"/m/{slug}/search?q=script").text
    assert (
        "<script>alert" not in page
        and "&lt;<mark>script</mark>&gt;alert(1)&lt;/<mark>script</mark>&gt;" in page
    )
    hostile = [s for s in _get(client, f"/m/{slug}/search.json?q=script")["sentences"]]
    assert any("".join(p["text"] for p in s["parts"]) == HOSTILE[0] for s in hostile)


def test_search_box_refuses_what_the_server_refuses(client, slug):
    page = client.get(f"/m/{slug}/search").text
    assert f'maxlength="{MAX_LENGTH}"' in page
    assert client.get(f"/m/{slug}/search.json?q={'a' * MAX_LENGTH}").status_code == 200
    error = _get(client, f"/m/{slug}/search.json?q={'a' * (MAX_LENGTH + 1)}", 400)
    assert error["status"] == 400 and "q" in error["error"]
    fragment = client.get(
        f"/m/{slug}/search?q={'a' * (MAX_LENGTH + 1)}", headers={"HX-Request": "true", "HX-Target": "results"}
    )
    assert fragment.status_code == 400 and "<html" not in fragment.text  # a message, shown in place


def _brute_force_neighbours(tiny, kind: str, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
    adapter, rows = tiny.adapter, []
    for block in adapter.blocks(tiny.model):
        if kind == "value":
            rows.append(adapter.value_matrix(block).detach().numpy())
        else:  # gated: the flattened g·uᵀ
            gates, ups = (
                adapter.gate_matrix(block).detach().numpy(),
                adapter.key_matrix(block).detach().numpy(),
            )
            rows.append(np.einsum("ni,nj->nij", gates, ups).reshape(len(gates), -1))
    vectors = np.concatenate(rows).astype(np.float64)
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cosine = unit @ unit.T
    np.fill_diagonal(cosine, -np.inf)
    order = np.argsort(-cosine, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(cosine, order, axis=1)


def test_key_page_shows_the_nearest_memories_as_brute_force(client, db, run, slug, tiny):
    layer, key = 1, 9
    body = _get(client, f"/m/{slug}/layers/{layer}/keys/{key}/related.json")
    neighbours = body["neighbours"]
    assert neighbours["gated"] is True
    memory = layer * tiny.n_keys + key
    for kind, shown in (("key", neighbours["by_key"]), ("value", neighbours["by_value"])):
        order, cosine = _brute_force_neighbours(tiny, kind)
        assert [(n["layer"], n["key"]) for n in shown] == [divmod(int(i), tiny.n_keys) for i in order[memory]]
        assert [n["cosine"] for n in shown] == pytest.approx(cosine[memory].tolist(), abs=1e-5)
        assert all(n["url"] == f"/m/{slug}/layers/{n['layer']}/keys/{n['key']}?run={run.id}" for n in shown)
    page = client.get(f"/m/{slug}/layers/{layer}/keys/{key}/related").text
    assert 'id="neighbours-key"' in page and 'id="neighbours-value"' in page
    first = neighbours["by_value"][0]
    assert f'href="/m/{slug}/layers/{first["layer"]}/keys/{first["key"]}?run={run.id}"' in page


def _unit_rows(tiny, kind: str) -> np.ndarray:
    """Every memory's key (gated: g ⊗ u flattened) or value as a unit row, layer-major: [n, ·] float64."""
    adapter, rows = tiny.adapter, []
    for block in adapter.blocks(tiny.model):
        if kind == "value":
            rows.append(adapter.value_matrix(block).detach().numpy())
        else:
            gates, ups = (
                adapter.gate_matrix(block).detach().numpy(),
                adapter.key_matrix(block).detach().numpy(),
            )
            rows.append(np.einsum("ni,nj->nij", gates, ups).reshape(len(gates), -1))
    vectors = np.concatenate(rows).astype(np.float64)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def test_the_related_section_shows_the_random_pair_baseline_of_the_layer(client, db, run, slug, tiny):
    """Issue 26 (15): the stored baseline of a layer is numpy's mean and 99th percentile of |cosine| over
    the engine's fixed sample of pairs, in the JSON twin and under each table."""
    for layer in range(tiny.n_layers):
        neighbours = _get(client, f"/m/{slug}/layers/{layer}/keys/3/related.json")["neighbours"]
        i, j = (x.numpy() for x in baseline_pairs(tiny.n_layers, tiny.n_keys, layer))
        for kind in ("key", "value"):
            unit = _unit_rows(tiny, kind)
            size = np.abs(np.einsum("pd,pd->p", unit[i], unit[j]))  # [pairs]
            baseline = neighbours[f"{kind}_baseline"]
            assert set(baseline) == {"pairs", "mean", "p99", "nearest"}
            assert baseline["pairs"] == BASELINE_PAIRS == len(i)
            assert baseline["mean"] == pytest.approx(size.mean(), abs=1e-6)
            assert baseline["p99"] == pytest.approx(np.percentile(size, 99), abs=1e-6)
    page = client.get(f"/m/{slug}/layers/1/keys/3/related").text
    key = _get(client, f"/m/{slug}/layers/1/keys/3/related.json")["neighbours"]["key_baseline"]
    shown = f"random pairs of this layer: mean |cosine| {key['mean']:.2g}, 99th percentile {key['p99']:.2g}"
    assert f'<small class="baseline" id="baseline-key">{shown}</small>' in page


def test_the_nearest_neighbour_baseline_is_the_layers_median_at_each_rank(client, run, slug, tiny):
    """Issue 39 (1): per layer and kind, rank r's baseline is the median over the layer's 48 memories of
    their own r-th nearest neighbour's cosine (brute force over all 144 memories here), in the JSON twin
    and, first and last, under each table."""
    for kind in ("key", "value"):
        _, cosines = _brute_force_neighbours(tiny, kind)  # [layers · keys, 10]
        by_layer = cosines.reshape(tiny.n_layers, tiny.n_keys, 10)
        for layer in range(tiny.n_layers):
            baseline = _get(client, f"/m/{slug}/layers/{layer}/keys/0/related.json")["neighbours"]
            medians = [
                (a + b) / 2 for a, b in np.sort(by_layer[layer], axis=0)[23:25].T
            ]  # 48: the middle two
            assert baseline[f"{kind}_baseline"]["nearest"] == pytest.approx(medians, abs=2e-6)
    page = client.get(f"/m/{slug}/layers/2/keys/0/related").text
    nearest = _get(client, f"/m/{slug}/layers/2/keys/0/related.json")["neighbours"]["value_baseline"][
        "nearest"
    ]
    shown = "this layer's memories' own neighbours, median: "
    shown += f"{nearest[0]:.3g} (nearest) … {nearest[-1]:.3g} (10th)"
    assert f'<small class="baseline" id="nearest-value">{shown}</small>' in page


def test_neighbours_at_or_below_the_median_of_their_rank_are_marked_and_only_they(client, run, slug, tiny):
    """Issue 39 (1): a neighbour at rank r is marked ≈ chance exactly when its cosine is at or below the
    layer's median r-th neighbour cosine (hand-computed here): at least half of each rank's neighbours over
    a layer (JSON `chance`; on the page a `chance` row with ≈ chance)."""
    brute = {kind: _brute_force_neighbours(tiny, kind)[1] for kind in ("key", "value")}
    marked_at_rank = {kind: np.zeros(10, int) for kind in brute}
    for layer, key in [(layer, key) for layer in range(tiny.n_layers) for key in range(tiny.n_keys)]:
        url = f"/m/{slug}/layers/{layer}/keys/{key}/related"
        neighbours = _get(client, f"{url}.json")["neighbours"]
        page = client.get(url).text if key % 8 == 0 else None
        for kind, rows in (("key", neighbours["by_key"]), ("value", neighbours["by_value"])):
            layer_rows = brute[kind][layer * tiny.n_keys : (layer + 1) * tiny.n_keys]  # [48, 10]
            median = np.median(layer_rows, axis=0)  # [10]
            mine = brute[kind][layer * tiny.n_keys + key]
            assert [n["chance"] for n in rows] == (mine <= median + 1e-9).tolist()
            marked_at_rank[kind] += [n["chance"] for n in rows]
            if page is not None:
                table = page.split(f'id="neighbours-{kind}"')[1].split("</table>")[0]
                marked = [n["chance"] for n in rows]
                assert [row.startswith(' class="chance"') for row in table.split("<tr")[2:]] == marked
                assert table.count("≈ chance</span>") == sum(marked)
    for kind in brute:  # at each rank, at least half of a layer's 48 (more where two tie at the median)
        assert all(24 * tiny.n_layers <= m < 48 * tiny.n_layers for m in marked_at_rank[kind]), marked_at_rank


def test_a_run_indexed_before_the_nearest_baseline_says_it_is_unknown(client, db, run, slug):
    """Issue 39 (1): a run stored before revision 0026 (no `nearest`) still renders: nothing is marked and
    the tables say the baseline is unknown."""
    stored = select(NeighbourBaseline.layer, NeighbourBaseline.kind, NeighbourBaseline.nearest)
    kept = db.execute(stored.where(NeighbourBaseline.run_id == run.id)).all()
    db.execute(update(NeighbourBaseline).where(NeighbourBaseline.run_id == run.id).values(nearest=None))
    db.commit()
    try:
        neighbours = _get(client, f"/m/{slug}/layers/1/keys/3/related.json")["neighbours"]
        assert (
            neighbours["value_baseline"]["nearest"] is None and neighbours["key_baseline"]["pairs"] == 20_000
        )
        assert all(n["chance"] is None for n in neighbours["by_key"] + neighbours["by_value"])
        page = client.get(f"/m/{slug}/layers/1/keys/3/related")
        assert page.status_code == 200
        section = page.text.split('id="neighbours"')[1].split("</section>")[0]
        unknown = "chance baseline unknown: indexed before it was stored; nothing is marked"
        assert section.count(unknown) == 2 and "≈ chance</span>" not in section.split("</p>")[1]
    finally:
        for layer, kind, nearest in kept:
            where = (NeighbourBaseline.run_id == run.id, NeighbourBaseline.layer == layer)
            db.execute(
                update(NeighbourBaseline)
                .where(*where, NeighbourBaseline.kind == kind)
                .values(nearest=nearest)
            )
        db.commit()


def test_a_run_stored_before_baselines_shows_neighbours_without_one(client, db, run, slug):
    stored = db.scalars(select(NeighbourBaseline).where(NeighbourBaseline.run_id == run.id)).all()
    rows = [
        dict(run_id=b.run_id, layer=b.layer, kind=b.kind, pairs=b.pairs, mean=b.mean, p99=b.p99)
        for b in stored
    ]
    db.execute(delete(NeighbourBaseline).where(NeighbourBaseline.run_id == run.id))
    db.commit()
    try:
        neighbours = _get(client, f"/m/{slug}/layers/1/keys/3/related.json")["neighbours"]
        assert (neighbours["key_baseline"], neighbours["value_baseline"]) == (None, None)
        assert len(neighbours["by_key"]) == 10 and all(n["chance"] is None for n in neighbours["by_key"])
        page = client.get(f"/m/{slug}/layers/1/keys/3/related")
        assert page.status_code == 200 and 'id="neighbours-key"' in page.text
        section = page.text.split('id="neighbours"')[1].split("</section>")[0]
        assert "≈ chance" not in section and 'id="baseline-key"' not in section
        assert section.count("chance baseline unknown: indexed before it was stored; nothing is marked") == 2
    finally:
        db.execute(insert(NeighbourBaseline), rows)
        db.commit()


def test_the_worker_stored_token_tables_and_neighbours_for_every_memory(db, run, tiny):
    n = tiny.n_layers * tiny.n_keys
    rows = select(func.count()).select_from(Neighbours).where(Neighbours.run_id == run.id)
    assert db.scalar(rows) == n  # a row a memory, both kinds in it
    baselines = select(func.count()).select_from(NeighbourBaseline).where(NeighbourBaseline.run_id == run.id)
    assert db.scalar(baselines) == 2 * tiny.n_layers
    tables = db.execute(
        select(TokenMemoryList.readout, func.count(), func.min(func.length(TokenMemoryList.data)))
        .where(TokenMemoryList.run_id == run.id)
        .group_by(TokenMemoryList.readout)
    ).all()
    vocab = tiny.model.get_output_embeddings().weight.shape[0]
    assert {tuple(row) for row in tables} == {("raw", vocab, 4 * 32 * 8), ("norm", vocab, 4 * 32 * 8)}


def test_marked_parts_cut_at_every_occurrence_as_typed():
    parts = search.marked_parts("A+B and a+b, then ab", "a+b")  # regex characters are plain text
    assert [(p.text, p.marked) for p in parts] == [
        ("A+B", True),
        (" and ", False),
        ("a+b", True),
        (", then ab", False),
    ]
    assert [(p.text, p.marked) for p in search.marked_parts("x y", "␣y")] == [("x", False), (" y", True)]
    assert [(p.text, p.marked) for p in search.marked_parts("nothing here", "zz")] == [
        ("nothing here", False)
    ]
