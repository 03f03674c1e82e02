"""All pairs' similarities at bfloat16 speed, with answers that are the exact ones (the neighbours' search,
ffmem.engine.relations.neighbours.nearest).

A similarity is s = Π_f c_f, the product over the factors f of the cosines c_f = a·b of two rows made unit
vectors in float32 (a = row / ‖row‖). A block of them is computed as c̃ = bf16(ã·b̃), ã = bf16(a): on a CPU
with bf16 dot products several times faster than float32 (docs/benchmarks.md). Each c̃ is within a bound
of c computed from the operands themselves (as ffmem.engine.values.bf16_logits bounds its logits):

    a·b = ã·b̃ + δa·b + ã·δb                   (δa = a − ã, δb = b − b̃: exact identities)
    |δa·b| ≤ ‖δa‖·‖b‖,  |ã·δb| ≤ ‖ã‖·‖δb‖       (Cauchy–Schwarz)
    |fl32(ã·b̃) − ã·b̃| ≤ γ_d·‖ã‖·‖b̃‖,  γ_d = d·2⁻²⁴ / (1 − d·2⁻²⁴)   (products of two bf16 are exact in
                                                                float32: only the sums round)
    |c̃ − fl32(ã·b̃)| ≤ 2⁻⁸ / (1 − 2⁻⁸) · |c̃|                        (the sum rounded to bf16, to nearest)

so |c̃ − c| ≤ e = ε + OUT·|c̃|, ε = (‖δa‖·‖b‖ + ‖ã‖·‖δb‖ + γ_d·‖ã‖·‖b̃‖)·SLACK, every norm with a slack of
2⁻¹⁰ for its own rounding (bf16_logits' OUT and SLACK). For unit vectors ‖δa‖ ≈ 2⁻¹⁰ (the actual rounding,
not the worst case), so e ≈ 0.003 + 0.004·|c̃|. A product of factors: s̃ = Π c̃_f (exact in float64) and

    |s − s̃| ≤ Π_f (|c̃_f| + e_f) − Π_f |c̃_f|      (expand Π (c̃_f + (c_f − c̃_f)))

so every pair has an upper bound ŝ = s̃ + that ≥ s. Where a CPU lacks bf16 dot products (torch would emulate
them, slower than float32) the product is taken in float32 (ã = a: δ = 0) and rounded to bf16 after it,
so the same bound holds.

**The search** (`nearest_pools`): every block pair of the symmetric half once, each product folded into
every row's pool of the `POOL` largest s̃ (a row's block and, off the diagonal, its column's), and per row
`outside`, the largest ŝ of every pair that left or never entered its pool. Then (`rescored`) each pool is
rescored exactly (float32 unit rows, products summed in float64): λ, the k-th largest exact similarity of
the pool, is a lower bound of the true k-th largest; where `outside` < λ no pair outside the pool can be
among the top k, so the pool's exact top k (ties: the lower index first) is the answer. A row where it is
not (exact ties at the k-th, a row near nothing, a zero row) is recomputed whole, exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numba
import numpy as np
import torch

from ffmem.engine.values.bf16_logits import OUT, SLACK, bf16_available

POOL = 32  # candidates kept per row before the exact rescoring
LOW = np.float32(-3.0e38)  # below every similarity: an empty pool slot (finite, for fastmath)
MARGIN = 2.0**-20  # ŝ's float32 roundings (a few, of numbers ≤ 1.1) and the exact sums' float64 ones


def row_norms(rows: torch.Tensor, chunk: int) -> torch.Tensor:
    """Each row's norm as torch.nn.functional.normalize divides by it, `chunk` rows at a time in float32:
    [n, d] → [n] float32."""
    return torch.cat(
        [torch.linalg.vector_norm(rows[i : i + chunk].float(), dim=1) for i in range(0, rows.shape[0], chunk)]
    ).clamp_min(1e-12)


class Factor:
    """One factor's rows prepared for the search: float32 rows [n, d] and their norms (the exact unit
    row is row / norm, in float32), bf16 unit rows [n, d], and per row ‖δa‖ (`rounding`), ‖ã‖ (`size`) and
    ‖a‖ (`length`), each with its slack."""

    def __init__(self, rows: torch.Tensor, block: int, fast: bool) -> None:
        n, d = rows.shape
        self.rows = rows.detach().float().contiguous()  # [n, d] (the model's own weight where float32)
        self.norm = row_norms(self.rows, block)  # [n]
        self.fast = fast
        self.units = torch.empty(n, d, dtype=torch.bfloat16 if fast else torch.float32)  # [n, d]
        self.rounding, self.size, self.length = (torch.empty(n, dtype=torch.float64) for _ in range(3))
        for i in range(0, n, block):
            unit = self.rows[i : i + block] / self.norm[i : i + block, None]  # [b, d] float32
            rounded = unit.bfloat16().float() if fast else unit  # [b, d]
            self.units[i : i + block] = rounded
            self.rounding[i : i + block] = (unit - rounded).double().norm(dim=1) * SLACK
            self.size[i : i + block] = rounded.double().norm(dim=1) * SLACK
            self.length[i : i + block] = unit.double().norm(dim=1) * SLACK
        self.gamma = d * 2.0**-24 / (1 - d * 2.0**-24)
        self.out = torch.empty(0, dtype=torch.bfloat16)  # a block's products, reused (`product`)

    def error(self) -> np.ndarray:
        """Per row, ε of its pairs with any row (module docstring: the largest of the others' norms):
        [n] float32, rounded up."""
        others = self.rounding.max() + self.gamma * self.size.max()  # ‖δb‖ + γ_d·‖b̃‖ at most
        error = (self.rounding * self.length.max() + self.size * others) * SLACK  # [n] float64
        return (error * (1 + 2.0**-20)).float().numpy()

    def product(self, rows: slice, columns: slice) -> np.ndarray:
        """c̃ of a block: [rows, columns] as the bits of bfloat16 (int16)."""
        left, right = self.units[rows], self.units[columns]  # [bi, d], [bj, d]
        if not self.fast:
            return (left @ right.T).bfloat16().view(torch.int16).numpy()  # [bi, bj]
        # Into one buffer, valid until the next pair: a fresh 32 MiB product would be faulted in page
        # by page at every block pair.
        if len(self.out) < len(left) * len(right):
            self.out = torch.empty(len(left) * len(right), dtype=torch.bfloat16)
        product = self.out[: len(left) * len(right)].view(len(left), len(right))  # [bi, bj]
        torch.matmul(left, right.T, out=product)
        return product.view(torch.int16).numpy()


def nearest_pools(
    factors: Sequence[torch.Tensor],
    k: int,
    block: int,
    report: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `k` most similar other rows, exactly (module docstring): (indices [n, k] int64,
    similarities [n, k] float32), the highest first, ties by the lower index. `report(done, total)` after
    each block pair."""
    fast = bf16_available()
    prepared = [Factor(f, block, fast) for f in factors]
    n = prepared[0].rows.shape[0]
    pools = Pools(n, min(max(POOL, 2 * k), n - 1))
    errors = np.stack([f.error() for f in prepared])  # [F, n] float32: each row's ε
    starts = range(0, n, block)
    # the diagonal blocks first: every pool fills on its own rows (cheaper than as a column of another's)
    pairs = [(i, i) for i in starts] + [(i, j) for i in starts for j in starts if j > i]
    for done, (i, j) in enumerate(pairs, 1):
        rows, columns = slice(i, min(i + block, n)), slice(j, min(j + block, n))
        products = tuple(f.product(rows, columns) for f in prepared)  # F × [bi, bj] bf16 bits
        _fold(products, i, j, errors, *pools.arrays())
        if report is not None:
            report(done, len(pairs))
    return rescored(prepared, k, pools.ids, pools.outside)


class Pools:
    """Every row's pool: the `pool` largest s̃ [n, pool] float32 (largest first, LOW where empty), their
    rows [n, pool] int64 and ŝ [n, pool] float32; per row the pool's last s̃ (`floor` [n]) and `outside`
    [n], the largest ŝ of a pair not in it."""

    def __init__(self, n: int, pool: int) -> None:
        self.values = np.full((n, pool), LOW, np.float32)
        self.ids = np.full((n, pool), -1, np.int64)
        self.uppers = np.full((n, pool), LOW, np.float32)
        self.floor = np.full(n, LOW, np.float32)
        self.outside = np.full(n, LOW, np.float32)

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.values, self.ids, self.uppers, self.floor, self.outside


def rescored(
    prepared: Sequence[Factor], k: int, ids: np.ndarray, outside: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools' exact top k (module docstring), rows whose pool cannot be trusted recomputed whole."""
    rows = tuple(f.rows.numpy() for f in prepared)
    norms = tuple(f.norm.numpy() for f in prepared)
    n = ids.shape[0]
    best = np.zeros((n, k))
    best_index = np.zeros((n, k), np.int64)
    whole = np.zeros(n, np.bool_)
    _rescore(rows, norms, ids, outside, best, best_index, whole)
    for row in np.flatnonzero(whole):
        _exact_row(rows, norms, row, best[row], best_index[row])
    return torch.from_numpy(best_index), torch.from_numpy(best.astype(np.float32))


@numba.njit(nogil=True, cache=True)
def _insert(values, ids, uppers, floor, outside, row, value, index, upper):
    """Put candidate `index` (s̃ `value`, ŝ `upper`) into the row's pool if it beats its last; what leaves
    or never enters counts in `outside`."""
    last = values.shape[1] - 1
    if value <= values[row, last]:
        outside[row] = max(outside[row], upper)
        return
    outside[row] = max(outside[row], uppers[row, last])
    at = last
    while at > 0 and value > values[row, at - 1]:
        values[row, at], ids[row, at] = values[row, at - 1], ids[row, at - 1]
        uppers[row, at] = uppers[row, at - 1]
        at -= 1
    values[row, at], ids[row, at], uppers[row, at] = value, index, upper
    floor[row] = values[row, last]


@numba.njit(nogil=True, cache=True, fastmath=True)  # (no infinity or NaN here: LOW is finite)
def _fold(products, first_row, first_column, errors, values, ids, uppers, floor, outside):
    """Fold one block's products (F × [bi, bj] bf16 bits) into the pools: every pair (r, c) a candidate
    of row r and, off the diagonal block, of row c; on it, a row is not its own candidate. In float32:
    s̃ is exact (a product of bf16 values), ŝ off by float32 roundings that MARGIN covers."""
    rows, columns = products[0].shape
    diagonal = first_row == first_column
    similarity = np.empty(columns, np.float32)  # [bj] s̃
    upper = np.empty(columns, np.float32)  # [bj] ŝ
    size = np.empty(columns, np.float32)  # [bj] Π |c̃|
    reach = np.empty(columns, np.float32)  # [bj] Π (|c̃| + e)
    staying = np.empty(columns, np.float32)  # [bj] ŝ of the row's pairs that stay out of its pool
    bits = np.empty(columns, np.uint32)
    widened = bits.view(np.float32)  # [bj] c̃
    out = np.float32(OUT * SLACK)
    for r in range(rows):
        row = first_row + r
        similarity[:] = 1.0
        size[:] = 1.0
        reach[:] = 1.0
        for f in range(len(products)):
            error = errors[f, row]
            product = products[f][r]  # [bj]
            for c in range(columns):
                bits[c] = np.uint32(np.uint16(product[c])) << 16
            for c in range(columns):
                cosine = widened[c]
                similarity[c] *= cosine
                size[c] *= abs(cosine)
                reach[c] *= abs(cosine) + error + out * abs(cosine)
        for c in range(columns):
            upper[c] = similarity[c] + (reach[c] - size[c])
        if diagonal:  # a row is not its own candidate
            similarity[r] = upper[r] = LOW
        start = floor[row]
        for c in range(columns):  # the row's pairs that stay out, before any enters
            staying[c] = upper[c] if similarity[c] <= start else LOW
        outside[row] = max(outside[row], np.max(staying))  # (a buffer's max: vectorized, a running one not)
        for c in range(columns):
            if similarity[c] > start:  # (against the pool's floor as it rises: few calls)
                if similarity[c] > floor[row]:
                    column = first_column + c
                    _insert(values, ids, uppers, floor, outside, row, similarity[c], column, upper[c])
                else:
                    outside[row] = max(outside[row], upper[c])
        if diagonal:
            continue
        for c in range(columns):  # the same pairs as candidates of their columns' rows: those that stay out
            column = first_column + c
            stays = similarity[c] <= floor[column]
            outside[column] = max(outside[column], upper[c] if stays else LOW)
        for c in range(columns):
            if similarity[c] > floor[first_column + c]:
                _insert(values, ids, uppers, floor, outside, first_column + c, similarity[c], row, upper[c])


@numba.njit(nogil=True, inline="always")
def _similarity(rows, norms, a, b):
    """The exact similarity of rows a and b: Π_f of the float32 unit rows' dot product summed in float64."""
    total = 1.0
    for f in range(len(rows)):
        dot = 0.0
        for i in range(rows[f].shape[1]):
            dot += np.float64(rows[f][a, i] / norms[f][a]) * np.float64(rows[f][b, i] / norms[f][b])
        total *= dot
    return total


@numba.njit(nogil=True, inline="always")
def _top(exact, index, k, best, best_index):
    """The k largest of exact (ties: the lower index first) into best, best_index."""
    by_index = np.argsort(index, kind="mergesort")
    order = by_index[np.argsort(-exact[by_index], kind="mergesort")[:k]]
    best[:] = exact[order]
    best_index[:] = index[order]


EXACT_MATH = {"reassoc", "contract", "nsz"}  # the float64 sums vectorized (no infinities there)


@numba.njit(nogil=True, cache=True, fastmath=EXACT_MATH)
def _rescore(rows, norms, ids, outside, best, best_index, whole):
    n, pool = ids.shape
    k = best.shape[1]
    exact = np.empty(pool)
    for row in range(n):
        for j in range(pool):
            exact[j] = _similarity(rows, norms, row, ids[row, j])
        _top(exact, ids[row], k, best[row], best_index[row])
        whole[row] = not outside[row] < best[row, k - 1] - MARGIN


@numba.njit(nogil=True, cache=True, fastmath=EXACT_MATH)
def _exact_row(rows, norms, row, best, best_index):
    n = rows[0].shape[0]
    exact = np.empty(n - 1)
    index = np.empty(n - 1, np.int64)
    at = 0
    for other in range(n):
        if other != row:
            exact[at] = _similarity(rows, norms, row, other)
            index[at] = other
            at += 1
    _top(exact, index, best.shape[0], best, best_index)
