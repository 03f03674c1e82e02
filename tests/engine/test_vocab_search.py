"""Full-vocabulary token search without torch (ffmem.engine.vocab_search) against the model itself:
per supported family, a token's logit in every value under both readouts equals the direct readout
(projection.value_logits) within float16 storage; the ranking equals a brute-force ranking of every
value, exactly on float32 arrays and to float16 resolution on the stored ones; log Z and
probabilities match the value tokens' softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_adapters import CASES, Case, _tiny

from ffmem.engine.adapters import adapter_for
from ffmem.engine.loading import LoadedModel
from ffmem.engine.projection import project_layer, search_arrays, value_logits
from ffmem.engine.vocab_search import BLOCK, SearchArrays, from_npy, strongest, to_npy


def _loaded(model, name: str) -> LoadedModel:
    return LoadedModel(model, None, adapter_for(model), name, name, None, torch.device("cpu"), torch.float32)


def _arrays(loaded: LoadedModel) -> tuple[SearchArrays, np.ndarray]:
    """The stored arrays read back as the web reads them (through .npy bytes), and E [vocab, d]."""
    log_z = {}
    for layer in range(loaded.n_layers):
        for p in project_layer(loaded, layer, n=4):
            log_z[layer, p.readout] = p.log_z
    stored = [(name, part, from_npy(to_npy(array))) for name, part, array in search_arrays(loaded, log_z)]
    values = [a for name, _, a in sorted(stored, key=lambda s: s[1]) if name == "values"]
    singles = {name: a for name, part, a in stored if name not in ("values", "unembedding")}
    blocks = sorted((part, a) for name, part, a in stored if name == "unembedding")
    assert [part for part, _ in blocks] == list(range(len(blocks)))
    assert all(a.shape[0] == BLOCK for _, a in blocks[:-1])
    return SearchArrays.from_parts(values, singles), np.concatenate([a for _, a in blocks])


def _all_logits(loaded: LoadedModel, readout: str) -> torch.Tensor:
    """[layers · keys, vocab] float32: every value's direct readout."""
    blocks = loaded.adapter.blocks(loaded.model)
    values = torch.cat([loaded.adapter.value_matrix(b) for b in blocks])
    with torch.no_grad():
        return value_logits(loaded, values, readout).float()


@pytest.fixture(scope="module", params=CASES, ids=lambda case: case.name)
def case(request) -> tuple[Case, LoadedModel]:
    return request.param, _loaded(_tiny(request.param), request.param.name)


@pytest.mark.parametrize("readout", ["raw", "norm"])
def test_logits_equal_the_direct_readout_for_every_family(case, readout):
    _, loaded = case
    arrays, embedding = _arrays(loaded)
    direct = _all_logits(loaded, readout).numpy()  # [n, vocab]
    tokens = [0, 5, 77, direct.shape[1] - 1]
    got = arrays.logits(embedding[tokens], tokens, readout)  # [4, n]
    scale = np.abs(direct).max()
    diff = np.abs(got - direct[:, tokens].T).max()
    assert diff < 3e-3 * scale, f"max |logit − direct| = {diff} (scale {scale})"
    log_z = torch.logsumexp(torch.from_numpy(direct), dim=-1).numpy()
    np.testing.assert_allclose(arrays.log_z(readout), log_z, rtol=1e-5, atol=1e-5)


def test_ranking_equals_brute_force_over_every_value(tiny):
    """Exactly, on float32 copies of V and E; the stored float16 ones to their resolution."""
    arrays, embedding = _arrays(tiny)
    blocks = tiny.adapter.blocks(tiny.model)
    exact = SearchArrays(
        values=torch.cat([tiny.adapter.value_matrix(b) for b in blocks]).detach().numpy(),
        n_keys=tiny.n_keys,
        stats=arrays.stats,
        norm=arrays.norm,
        head_bias=arrays.head_bias,
    )
    weight = tiny.model.lm_head.weight.detach().numpy()  # [vocab, d]
    for readout in ("raw", "norm"):
        direct = _all_logits(tiny, readout).numpy()  # [n, vocab]
        log_probs = direct - torch.logsumexp(torch.from_numpy(direct), dim=-1, keepdim=True).numpy()
        for token in (3, 42, 150):
            for by, scores in (("logit", direct[:, token]), ("prob", log_probs[:, token])):
                found = exact.search(weight[[token]], [token], readout=readout, by=by, limit=20)
                for direction in (1, -1):
                    order = np.lexsort((np.arange(len(scores)), -direction * scores))[:20]
                    got = [(h.layer, h.key) for h in found[direction]]
                    assert got == [divmod(int(i), tiny.n_keys) for i in order], (readout, by, direction)
                    hit = found[direction][0]
                    assert hit.prob == pytest.approx(np.exp(log_probs[order[0], token]), rel=1e-4)
                stored = arrays.search(embedding[[token]], [token], readout=readout, by=by, limit=20)
                for direction in (1, -1):
                    best = np.sort(direction * scores)[::-1][:20]
                    own = [direction * scores[h.layer * tiny.n_keys + h.key] for h in stored[direction]]
                    tolerance = 3e-3 * np.abs(direct).max()
                    assert np.abs(np.array(own) - best).max() < tolerance, (readout, by, direction)


def test_several_tokens_are_ranked_together():
    scores = np.array([[1.0, 5.0, 3.0], [4.0, 5.0, 0.0]])  # [tokens, memories]
    rows, columns = strongest(scores, 1, 4)
    assert list(zip(rows, columns, strict=True)) == [(0, 1), (1, 1), (1, 0), (0, 2)]  # ties: memory, token
    rows, columns = strongest(scores, -1, 2)
    assert list(zip(rows, columns, strict=True)) == [(1, 2), (0, 0)]
    assert strongest(scores, 1, 100)[0].size == 6
