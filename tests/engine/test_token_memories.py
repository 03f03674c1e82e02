"""The token → memories table (ffmem.engine.values.token_memories) against a brute-force ranking of every
memory's full readout (numpy argsort over all logits, in float64): for each family and readout, every token's
four lists (by logit and by probability, promoting and suppressing) hold the memories and scores the brute
force gives, whatever the chunk of values the projection reads, on the CPU's compiled pass and on the torch
merge the GPU runs; a depth past the memories leaves empty slots."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_adapters import CASES, _tiny

from ffmem.engine.model.adapters import adapter_for
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.values.projection import READOUTS, project_layer, value_logits
from ffmem.engine.values.token_memories import LISTS, TokenMemories
from ffmem.store.memory_lists import TOKEN_LISTS


def _loaded(model, name: str) -> LoadedModel:
    return LoadedModel(model, None, adapter_for(model), name, name, None, torch.device("cpu"), torch.float32)


def _table(loaded: LoadedModel, readout: str, depth: int, chunk: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """The table as the worker computes it: filled by the projection of every layer's values."""
    tables = {r: TokenMemories.of(loaded, depth) for r in READOUTS}
    for layer in range(loaded.n_layers):
        for _ in project_layer(loaded, layer, n=3, chunk=chunk, token_memories=tables):
            pass
    memories, scores = tables[readout].lists()
    return memories.numpy(), scores.numpy()


def _brute_force(loaded: LoadedModel, readout: str) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    """(by, direction) → (memories, scores) [vocab, every memory], best first: a full argsort per token."""
    blocks = loaded.adapter.blocks(loaded.model)
    values = torch.cat([loaded.adapter.value_matrix(b) for b in blocks])  # [memories, d], layer-major
    with torch.no_grad():
        logits = value_logits(loaded, values, readout).double().numpy()  # [memories, vocab]
    log_prob = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))  # [memories, vocab]
    ranked = {}
    for by, direction in LISTS:
        score = (logits if by == "logit" else log_prob).T  # [vocab, memories]
        order = np.argsort(-direction * score, axis=1, kind="stable")  # [vocab, memories]
        ranked[by, direction] = order, np.take_along_axis(score, order, axis=1)
    return ranked


@pytest.fixture(scope="module", params=CASES, ids=lambda case: case.name)
def loaded(request) -> LoadedModel:
    return _loaded(_tiny(request.param), request.param.name)


@pytest.fixture(params=["compiled", "torch"])
def path(request, monkeypatch) -> str:
    """Which way the lists are kept: the CPU's compiled pass, or the torch merge (the GPU's) on the CPU."""
    if request.param == "torch":
        monkeypatch.setattr(TokenMemories, "_add_compiled", TokenMemories._add_torch)
    return request.param


@pytest.mark.parametrize("readout", READOUTS)
@pytest.mark.parametrize(
    ("depth", "chunk"), [(10, 512), (10, 7), (1, 5)], ids=["one chunk", "chunks", "depth 1"]
)
def test_every_token_list_equals_the_brute_force_ranking(loaded, path, readout, depth, chunk):
    memories, scores = _table(loaded, readout, depth, chunk)  # [vocab, lists, depth] each
    assert memories.shape == scores.shape == (loaded.model.config.vocab_size, len(LISTS), depth)
    for (by, direction), (order, expected) in _brute_force(loaded, readout).items():
        index = LISTS.index((by, direction))
        listed, listed_scores = memories[:, index], scores[:, index]
        # The best `depth` scores, each the listed memory's own; the same memories as the brute force's
        # but where float32 and float64 order two near-equal scores apart.
        np.testing.assert_allclose(listed_scores, expected[:, :depth], rtol=1e-5, atol=1e-5)
        own = np.take_along_axis(expected, np.argsort(order, axis=1), axis=1)  # [vocab, memories]
        np.testing.assert_allclose(
            np.take_along_axis(own, listed, axis=1), listed_scores, rtol=1e-5, atol=1e-5
        )
        assert all(len(set(row)) == depth for row in listed.tolist()), "a memory once per list"
        assert (listed == order[:, :depth]).mean() > 0.99


def test_a_depth_past_the_memories_leaves_empty_slots(loaded, path):
    n = loaded.n_layers * loaded.n_keys
    memories, scores = _table(loaded, "raw", n + 3)
    assert (memories[:, :, :n] >= 0).all() and (memories[:, :, n:] == -1).all()
    signs = np.array([d for _, d in LISTS])[None, :, None]
    assert (scores[:, :, n:] == -signs * np.inf).all(), (
        "an empty slot ranks last: −inf promotes, +inf suppresses"
    )
    for row in memories[:, :, :n].reshape(-1, n):
        assert sorted(row.tolist()) == list(range(n)), "every memory once in every list"


def test_the_store_packs_the_lists_in_the_order_the_engine_computes_them():
    assert TOKEN_LISTS == LISTS
