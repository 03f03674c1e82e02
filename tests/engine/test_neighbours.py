"""Memory neighbours (ffmem.engine.relations.neighbours) equal a brute-force cosine over every pair of
memories: on the tiny gated Llama (keys: the cosine of the flattened g·uᵀ forms), on a plain-FF model, and
with blocks smaller than the matrix so the symmetric block merge is exercised."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_adapters import CASES, _tiny

from ffmem.engine.model.adapters import adapter_for
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.relations.neighbours import (
    BASELINE_PAIRS,
    baseline_pairs,
    key_factors,
    memory_baselines,
    memory_neighbours,
    nearest,
    nearest_baseline,
)


def _brute_force(vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k highest-cosine other rows, written out: every pair, then a full sort."""
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cosine = unit @ unit.T
    np.fill_diagonal(cosine, -np.inf)
    order = np.argsort(-cosine, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(cosine, order, axis=1)


def _rows(loaded: LoadedModel, kind: str) -> np.ndarray:
    """Each memory's key (for a gated FF: g ⊗ u flattened) or value, layer-major."""
    adapter, rows = loaded.adapter, []
    for block in adapter.blocks(loaded.model):
        if kind == "value":
            rows.append(adapter.value_matrix(block).detach().numpy())
        elif adapter.gates is None:
            rows.append(adapter.key_matrix(block).detach().numpy())
        else:
            gates, ups = (
                adapter.gate_matrix(block).detach().numpy(),
                adapter.key_matrix(block).detach().numpy(),
            )
            rows.append(np.einsum("ni,nj->nij", gates, ups).reshape(len(gates), -1))
    return np.concatenate(rows).astype(np.float64)


@pytest.mark.parametrize("block", [4096, 50])
def test_neighbours_equal_brute_force_cosine_on_the_tiny_gated_model(tiny, block):
    found = memory_neighbours(tiny, k=10, block=block)
    assert len(key_factors(tiny)) == 2, "the tiny Llama is gated: gate and up rows"
    for kind in ("key", "value"):
        index, cosine = found[kind]
        expected_index, expected_cosine = _brute_force(_rows(tiny, kind), 10)
        n = tiny.n_layers * tiny.n_keys
        assert index.shape == (n, 10) and cosine.shape == (n, 10)
        np.testing.assert_allclose(cosine.numpy(), expected_cosine, atol=1e-5)
        assert (index.numpy() == expected_index).all(), kind
        assert not (index.numpy() == np.arange(n)[:, None]).any(), "a memory is not its own neighbour"


def test_neighbours_of_a_plain_ff_are_key_cosines():
    case = next(c for c in CASES if c.name == "gpt2")
    model = _tiny(case)
    loaded = LoadedModel(
        model, None, adapter_for(model), "gpt2", "gpt2", None, torch.device("cpu"), torch.float32
    )
    found = memory_neighbours(loaded, k=5, block=48)
    for kind in ("key", "value"):
        expected_index, expected_cosine = _brute_force(_rows(loaded, kind), 5)
        np.testing.assert_allclose(found[kind][1].numpy(), expected_cosine, atol=1e-5)
        assert (found[kind][0].numpy() == expected_index).all(), kind


def test_reports_each_block_pair_and_zero_rows_have_cosine_zero():
    rows = torch.randn(10, 4)
    rows[3] = 0
    calls = []
    index, cosine = nearest([rows], k=9, block=4, report=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 6) for i in range(1, 7)]  # 3 row blocks: 3 + 2 + 1 pairs
    assert torch.all(cosine[3] == 0) and sorted(index[3].tolist()) == [0, 1, 2, 4, 5, 6, 7, 8, 9]


def test_the_random_pair_baseline_equals_numpy_on_the_tiny_model(tiny):
    """Issue 26 (15): per layer and kind, the mean and 99th percentile of |cosine| over the fixed sample of
    pairs (a memory of the layer, any other memory) equal numpy's on the weights (keys: g ⊗ u flattened),
    whatever the chunk."""
    found = memory_baselines(tiny, pairs=5000, chunk=777)
    assert memory_baselines(tiny, pairs=5000, chunk=5000) == found  # the chunking changes nothing
    n = tiny.n_layers * tiny.n_keys
    for kind in ("key", "value"):
        rows = _rows(tiny, kind)
        unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)  # [n, d]
        assert len(found[kind]) == tiny.n_layers
        for layer, baseline in enumerate(found[kind]):
            i, j = (x.numpy() for x in baseline_pairs(tiny.n_layers, tiny.n_keys, layer, 5000))
            assert ((i // tiny.n_keys) == layer).all() and (i != j).all() and j.min() >= 0 and j.max() < n
            assert len(set(j // tiny.n_keys)) == tiny.n_layers  # the other memory from any layer
            size = np.abs(np.einsum("pd,pd->p", unit[i], unit[j]))  # [pairs]
            assert baseline.pairs == 5000
            assert baseline.mean == pytest.approx(size.mean(), abs=1e-6), (kind, layer)
            assert baseline.p99 == pytest.approx(np.percentile(size, 99), abs=1e-6), (kind, layer)
    same = baseline_pairs(3, 48, 1)
    assert all((a == b).all() for a, b in zip(same, baseline_pairs(3, 48, 1), strict=True))  # fixed, seeded
    assert len(same[0]) == BASELINE_PAIRS


def test_the_nearest_neighbour_baseline_is_each_layers_median_at_each_rank():
    """Issue 39 (1): per layer, the median over its memories of their r-th neighbour's similarity, written
    out: 3 layers × 4 keys (an even count: the mean of the middle two), 2 ranks."""
    similarities = torch.tensor(
        [[0.9, 0.5], [0.7, 0.6], [0.8, 0.2], [0.3, 0.1]]  # layer 0
        + [[0.4, 0.4], [0.4, 0.3], [0.6, 0.0], [0.2, -0.1]]  # layer 1 (a tie at the middle)
        + [[1.0, 0.9], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]  # layer 2
    )
    found = nearest_baseline(similarities, n_keys=4)
    expected = [[(0.7 + 0.8) / 2, (0.5 + 0.2) / 2], [0.4, (0.3 + 0.0) / 2], [0.5, 0.5]]
    assert found.shape == (3, 2) and found.flatten().tolist() == pytest.approx(np.ravel(expected), abs=1e-7)
