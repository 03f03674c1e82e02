"""Memories that fire on the same things, or write the same things: each memory's nearest memories
across all layers by the cosine of their key directions and of their value directions.

Keys. For a plain FF, m_i = f(x · k_i): the key is k_i. For a gated FF (SwiGLU, Llama's and so the
default SmolLM2's), m_i = act(x · g_i) · (x · u_i): the gate row decides where the memory opens and the
up row the size and sign of what passes, so neither alone is "the key"; two memories fire on the same
inputs only when both agree. We compare them as one object, the rank-one form g_i u_iᵀ of the bilinear
part (m_i ≈ xᵀ g_i u_iᵀ x where the gate is open): the cosine of two such forms (Frobenius) is exactly
cos(g_i, g_j) · cos(u_i, u_j). It is high only when both rows agree, and negative when the gates agree
and the up rows oppose (the same inputs, opposite coefficients) — which "gate only" or "up only" would
call neighbours.

Values: cos(v_i, v_j). The top `k` by the highest cosine, the memory itself left out.

All pairs of 46,080 memories are compared exactly in blocks: each block pair once (the matrix is
symmetric), its block rows' running top-k merged as it goes; [block, block] at a time in memory.

**The random-pair baseline** says what "near" means: in d dimensions two unrelated directions still have
a cosine of order 1/√d, and a memory's nearest of 46,080 is the largest of many such. Per layer and
kind, a fixed seeded sample of `BASELINE_PAIRS` pairs — a memory of the layer and any other memory of any
layer, as the neighbours are searched — gives the mean and the 99th percentile of |similarity| (the same
similarity as the neighbours'); a neighbour below that percentile is no nearer than a random pair. The
pairs are compared `chunk` at a time: [chunk, d] rows in memory whatever the layer's size.

**The nearest-neighbour baseline** says what "nearest" means: a memory's r-th nearest of 46,080 is the
largest of many small cosines, so any memory has neighbours well above the random-pair percentile. Per
layer and kind, `nearest_baseline` takes the median, over the layer's memories (every one: the sample is
the whole layer), of each one's own r-th nearest neighbour's similarity, for r = 1 … k; a neighbour at
rank r at or below the median at rank r is no nearer than an ordinary memory's r-th nearest: ≈ chance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.relations.bf16_cosines import nearest_pools, row_norms

NEIGHBOURS = 10  # per memory and kind
BASELINE_PAIRS = 20_000  # random pairs per layer and kind for the baseline (200 above its p99)
BASELINE_SEED = 0
BASELINE_QUANTILE = 0.99


class Baseline(NamedTuple):
    """What random pairs reach in one layer (module docstring): |similarity| of `pairs` random pairs."""

    pairs: int
    mean: float  # mean |similarity|
    p99: float  # 99th percentile of |similarity| (linear interpolation, as numpy's default)


def key_factors(loaded: LoadedModel) -> list[torch.Tensor]:
    """The key directions of every memory, layer-major: [K] (plain FF) or [G, U] (gated), each
    [layers · keys, d]; a memory's key similarity is the product of its factors' cosines."""
    blocks = loaded.adapter.blocks(loaded.model)
    keys = torch.cat([loaded.adapter.key_matrix(block) for block in blocks])  # [n, d] (up rows if gated)
    if loaded.adapter.gates is None:
        return [keys]
    gates = torch.cat([loaded.adapter.gate_matrix(block) for block in blocks])  # [n, d]
    return [gates, keys]


def value_factors(loaded: LoadedModel) -> list[torch.Tensor]:
    """Every value, layer-major: [[layers · keys, d]]."""
    blocks = loaded.adapter.blocks(loaded.model)
    return [torch.cat([loaded.adapter.value_matrix(block) for block in blocks])]


def memory_neighbours(
    loaded: LoadedModel,
    k: int = NEIGHBOURS,
    block: int = 4096,
    report: Callable[[str, int, int], None] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """kind ("key", "value") → (indices [layers · keys, k] int64 layer-major, cosines [·, k] float32)."""
    with torch.inference_mode():
        return {
            kind: nearest(
                factors(loaded),
                k,
                block,
                None if report is None else lambda d, t, kind=kind: report(kind, d, t),
            )
            for kind, factors in (("key", key_factors), ("value", value_factors))
        }


def memory_baselines(
    loaded: LoadedModel, pairs: int = BASELINE_PAIRS, seed: int = BASELINE_SEED, chunk: int = 8192
) -> dict[str, list[Baseline]]:
    """kind ("key", "value") → each layer's random-pair Baseline, of the similarity the neighbours use."""
    with torch.inference_mode():
        return {
            kind: random_pair_baseline(factors(loaded), loaded.n_layers, loaded.n_keys, pairs, seed, chunk)
            for kind, factors in (("key", key_factors), ("value", value_factors))
        }


def baseline_pairs(
    n_layers: int, n_keys: int, layer: int, pairs: int = BASELINE_PAIRS, seed: int = BASELINE_SEED
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed sample of one layer: (i, j) [pairs] int64 each, layer-major memory indices, i a memory of
    `layer`, j any memory of any layer but i; the same for the same arguments on every machine."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    i = layer * n_keys + torch.randint(n_keys, (pairs,), generator=generator)  # [pairs]
    j = torch.randint(n_layers * n_keys - 1, (pairs,), generator=generator)  # [pairs]
    return i, j + (j >= i).long()  # skipping i itself, j uniform over the others


def random_pair_baseline(
    factors: Sequence[torch.Tensor],
    n_layers: int,
    n_keys: int,
    pairs: int = BASELINE_PAIRS,
    seed: int = BASELINE_SEED,
    chunk: int = 8192,
) -> list[Baseline]:
    """Per layer, |similarity(i, j)| = |Π_f cos(f[i], f[j])| over `baseline_pairs` (factors as `nearest`
    takes them: [layers · keys, d_f] each, layer-major): its mean and 99th percentile."""
    # Every row's norm once (what torch.nn.functional.normalize divides by: the same numbers), not once
    # per pair it is drawn in; and the pairs' rows in two buffers reused chunk after chunk (fresh ones
    # are faulted in page by page: that, not the arithmetic, took most of the time).
    norms = [row_norms(f, chunk) for f in factors]  # [n] each
    device = factors[0].device
    buffers = {
        d: (torch.empty(chunk, d, device=device), torch.empty(chunk, d, device=device))
        for d in {f.shape[1] for f in factors}
    }  # d_f → two [chunk, d_f] float32
    found = []
    for layer in range(n_layers):
        i, j = baseline_pairs(n_layers, n_keys, layer, pairs, seed)
        similarity = torch.ones(pairs, device=device)  # [pairs]
        for start in range(0, pairs, chunk):
            rows, columns = i[start : start + chunk].to(device), j[start : start + chunk].to(device)  # [c]
            part = similarity[start : start + chunk]  # [c], a view
            for f, norm in zip(factors, norms, strict=True):
                into = buffers[f.shape[1]]
                a = _unit_rows(f, norm, rows, into[0][: len(rows)])  # [c, d_f]
                b = _unit_rows(f, norm, columns, into[1][: len(rows)])  # [c, d_f]
                part *= a.mul_(b).sum(dim=1)  # [c]
        size = similarity.abs().double()  # [pairs]
        found.append(Baseline(pairs, float(size.mean()), float(torch.quantile(size, BASELINE_QUANTILE))))
    return found


def _unit_rows(f: torch.Tensor, norm: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows `index` of f divided by their norms, in float32 into `out` [c, d_f] (index_select: a copy of
    each row, three times faster than f[index]'s general indexing)."""
    if f.dtype == out.dtype:
        torch.index_select(f, 0, index, out=out)
    else:
        out.copy_(f.index_select(0, index))
    return out.div_(norm.index_select(0, index)[:, None])


def nearest_baseline(similarities: torch.Tensor, n_keys: int) -> torch.Tensor:
    """Per layer, the median over its memories of their r-th nearest neighbour's similarity (module
    docstring): similarities [layers · keys, k] as `nearest` gives them, layer-major → [layers, k] float64
    (the median of an even count is the mean of the middle two, as numpy's)."""
    by_layer = similarities.double().reshape(-1, n_keys, similarities.shape[1])  # [layers, keys, k]
    return torch.stack([torch.quantile(layer, 0.5, dim=0) for layer in by_layer])  # [layers, k]


def nearest(
    factors: Sequence[torch.Tensor],
    k: int = NEIGHBOURS,
    block: int = 4096,
    report: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `k` most similar other rows, similarity(i, j) = Π_f cos(f[i], f[j]) over the factors
    (one factor: the cosine): (indices [n, k] int64, similarities [n, k] float32, on the CPU), the
    highest first. A zero row has similarity 0 with every row. `report(done, total)` after each block
    pair. On a CPU, bf16 products with a rigorous bound and the candidates rescored exactly
    (ffmem.engine.relations.bf16_cosines); on another device, float32 products there (`nearest_on_device`)."""
    k = min(k, factors[0].shape[0] - 1)
    if factors[0].device.type == "cpu":
        return nearest_pools(factors, k, block, report)
    return nearest_on_device(factors, k, block, report)


def nearest_on_device(
    factors: Sequence[torch.Tensor],
    k: int = NEIGHBOURS,
    block: int = 4096,
    report: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`nearest` in float32 products on the factors' device: each block pair once, its block rows' and
    (transposed) columns' running top k merged as it goes."""
    # Each factor stays in its dtype; a block's rows are normalized in float32 as the block is read (no
    # float32 copy of every row: 2 GiB at Llama-3.2-1B's 131,072 memories for a gated key's two factors).
    n = factors[0].shape[0]
    norms = [row_norms(f, block) for f in factors]  # [n] each
    k = min(k, n - 1)
    device = factors[0].device
    best = torch.full((n, k), float("-inf"), device=device)
    best_index = torch.full((n, k), -1, dtype=torch.long, device=device)
    starts = list(range(0, n, block))
    total, done = len(starts) * (len(starts) + 1) // 2, 0

    def unit(f: int, part: slice) -> torch.Tensor:
        return factors[f][part].float() / norms[f][part, None]  # [b, d_f]: the rows as unit vectors

    for i in starts:
        rows = slice(i, min(i + block, n))
        row_units = [unit(f, rows) for f in range(len(factors))]
        for j in starts[starts.index(i) :]:
            columns = slice(j, min(j + block, n))
            similarity = row_units[0] @ unit(0, columns).T  # [bi, bj]
            for f in range(1, len(factors)):
                similarity *= row_units[f] @ unit(f, columns).T
            if i == j:
                similarity.fill_diagonal_(float("-inf"))  # not its own neighbour
            _merge(best, best_index, rows, similarity, j, k)
            if i != j:
                _merge(best, best_index, columns, similarity.T, i, k)
            done += 1
            if report is not None:
                report(done, total)
    return best_index.cpu(), best.cpu()


def _merge(
    best: torch.Tensor, best_index: torch.Tensor, rows: slice, similarity: torch.Tensor, offset: int, k: int
) -> None:
    """Fold the candidates `similarity` [rows, columns starting at `offset`] into the rows' top k."""
    values, index = similarity.topk(min(k, similarity.shape[1]), dim=1)  # [b, ≤k]
    values = torch.cat([best[rows], values], dim=1)
    index = torch.cat([best_index[rows], index + offset], dim=1)
    top, order = values.topk(k, dim=1)
    best[rows] = top
    best_index[rows] = index.gather(1, order)
