"""The neighbours' search at bf16 speed (ffmem.engine.relations.bf16_cosines) equals a float64 brute force
over every pair, exact ties and zero rows included (the rows whose pool cannot be trusted, recomputed
whole), and the bound it rests on holds for every pair of a block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ffmem.engine.relations import bf16_cosines
from ffmem.engine.relations.bf16_cosines import OUT, SLACK, Factor, nearest_pools
from ffmem.engine.relations.neighbours import nearest_on_device


def _brute_force(factors: list[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k most similar other rows, Π_f cos written out in float64, ties by the lower index."""
    similarity = np.ones((len(factors[0]), len(factors[0])))
    for rows in factors:
        norm = np.linalg.norm(rows, axis=1, keepdims=True)
        unit = rows / np.where(norm > 0, norm, 1)
        similarity *= unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    order = np.argsort(-similarity, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(similarity, order, axis=1)


def _factors(n: int, d: int, count: int, seed: int) -> list[torch.Tensor]:
    """Random rows sharing a few directions (near neighbours), some rows repeated (exact ties at the k-th),
    one zero row."""
    generator = torch.Generator().manual_seed(seed)
    found = []
    for _ in range(count):
        shared = torch.randn(8, d, generator=generator)
        rows = (
            torch.randn(n, d, generator=generator) + 3 * shared[torch.randint(8, (n,), generator=generator)]
        )
        rows[10:50] = rows[0]  # 41 copies: more than a pool share every similarity
        rows[5] = 0
        found.append(rows)
    return found


@pytest.mark.parametrize("count", [1, 2])
def test_the_pools_give_the_brute_force_neighbours(count, monkeypatch):
    factors = _factors(n=600, d=48, count=count, seed=count)
    whole = []
    recompute = bf16_cosines._exact_row
    monkeypatch.setattr(bf16_cosines, "_exact_row", lambda *a: whole.append(a[2]) or recompute(*a))
    index, similarity = nearest_pools(factors, k=10, block=128)
    expected_index, expected = _brute_force([f.double().numpy() for f in factors], 10)
    assert (index.numpy() == expected_index).all()
    np.testing.assert_allclose(similarity.numpy(), expected, atol=1e-6)
    assert {0, 5, *range(10, 50)} <= set(whole), "the zero row and the copies were recomputed whole"
    assert len(whole) < 100, f"the other rows' pools were trusted ({len(whole)} whole)"


def test_reports_each_block_pair_of_the_symmetric_half():
    calls = []
    nearest_pools([torch.randn(50, 8)], k=3, block=16, report=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 10) for i in range(1, 11)]  # 4 row blocks: 4 + 3 + 2 + 1 pairs


def test_the_bound_holds_for_every_pair_of_a_block():
    """|c̃ − c| ≤ ε_row + OUT·|c̃| (the module docstring), c the cosine of the float32 unit rows in float64."""
    rows = torch.randn(300, 576) * torch.rand(300, 1) * 10
    factor = Factor(rows, block=128, fast=True)
    approximate = torch.from_numpy(factor.product(slice(0, 300), slice(0, 300)))  # int16 bits of bf16
    approximate = approximate.view(torch.bfloat16).double()  # [300, 300] c̃
    unit = (rows / factor.norm[:, None]).double()  # the float32 unit rows, exactly
    exact = unit @ unit.T  # [300, 300]
    bound = torch.from_numpy(factor.error()).double()[:, None] + OUT * SLACK * approximate.abs()
    assert ((approximate - exact).abs() <= bound).all()
    assert (bound < 0.01).all() and (approximate - exact).abs().max() > 1e-4  # a bound, and a rounding


def test_the_device_path_gives_the_same_neighbours():
    """`nearest_on_device` (float32 blocks where the factors are: a GPU's path), run here on the CPU."""
    factors = [torch.randn(300, 32, generator=torch.Generator().manual_seed(f)) for f in range(2)]
    index, similarity = nearest_on_device(factors, k=7, block=64)
    expected_index, expected = _brute_force([f.double().numpy() for f in factors], 7)
    assert (index.numpy() == expected_index).all()
    np.testing.assert_allclose(similarity.numpy(), expected, atol=1e-6)
