"""A target token's rank in each value's readout, from the bf16 product (ffmem.engine.values.bf16_logits)
and exact where it counts.

The rank of target τ is the number of tokens t with L_t > L_τ, L the exact logits: the float32 operands'
products (exact in float64) summed in float64, plus the bias (relative error ~1e-16 of Σ|a_i·e_i|, so
ties are those of the real numbers: a token whose output-embedding row equals τ's ties with it and does
not count). Per value, L_τ is computed exactly, then each token is read from the bf16 logits L̃ with
its bound β_t ≥ |L̃_t − L_t|:

- L̃_t − β_t > L_τ: above (L_t ≥ L̃_t − β_t);   L̃_t + β_t ≤ L_τ: not above;
- otherwise (|L̃_t − L_τ| within β_t: ~5% of SmolLM2's vocabulary in its bulk): L_t computed exactly.

So the rank is the exact one, not a bf16 estimate. A float32 product (`value_logits`) rounds each logit
by up to ~d·2⁻²⁴·Σ|a_i·e_i|: its rank differs from this one only by tokens whose float32 logit lies
within that of the target's (near-ties, which float32 orders by the rounding of its summation order).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ffmem.engine.values.bf16_logits import EXACT_MATH, Bf16Logits, Unembedding, _bound, _dot

RANK_BLOCK = 256  # tokens whose embedding rows (0.6 MB at SmolLM2) the exact pass keeps in the cache


def bf16_target_ranks(table: Unembedding, chunk: Bf16Logits, targets: torch.Tensor) -> torch.Tensor:
    """Each row's rank of its target (module docstring): targets [c] token ids (−1: none) → [c] int64
    (−1 where the target is −1)."""
    if targets.shape != chunk.logits.shape[:1]:
        raise ValueError(f"{targets.shape[0]} targets for {chunk.logits.shape[0]} values")
    ranks = np.full(chunk.logits.shape[0], -1, np.int64)  # [c]
    targets = np.ascontiguousarray(targets.numpy().astype(np.int64))  # [c]
    _ranks(
        *chunk._arguments(table), chunk.read.numpy(), table.weight.numpy(), table.bias.numpy(), targets, ranks
    )
    return torch.from_numpy(ranks)


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=EXACT_MATH)
def _ranks(
    logits, rounding, norm, token_norm, token_rounding, token_slack, read, weight, bias, targets, ranks
):
    """ranks[row] = #{t : L_t > L_target} for each row with a target ≥ 0. A vector pass a row counts the
    tokens surely above and flags those within their bound of the target's exact logit; then a block of
    tokens at a time (their embedding rows stay in the cache while the chunk's rows pass), the flagged
    ones are computed exactly."""
    rows, vocab = logits.shape
    own = np.zeros(rows)  # [c]: each row's target logit, exact
    flags = np.zeros((rows, (vocab + 7) // 8 * 8), np.uint8)  # [c, vocab]: 1 within the bound of `own`
    for row in numba.prange(rows):
        target = targets[row]
        if target < 0:
            continue
        own[row] = theirs = _dot(read, weight, bias, row, target)
        a, b = rounding[row], norm[row]
        x, flagged = logits[row], flags[row]
        above = 0
        for t in range(vocab):
            beta = _bound(x[t], a, b, token_norm[t], token_rounding[t], token_slack[t])
            above += x[t] - beta > theirs
            flagged[t] = (x[t] - beta <= theirs) & (x[t] + beta > theirs) & (t != target)
        ranks[row] = above
    blocks = (vocab + RANK_BLOCK - 1) // RANK_BLOCK
    found = np.zeros((blocks, rows), np.int64)  # [blocks, c]: flagged tokens above, per block
    for block in numba.prange(blocks):
        for row in range(rows):
            if targets[row] < 0:
                continue
            words = flags[row, block * RANK_BLOCK : min(block * RANK_BLOCK + RANK_BLOCK, flags.shape[1])]
            for word, packed in enumerate(words.view(np.uint64)):
                if packed:
                    for t in range(block * RANK_BLOCK + 8 * word, block * RANK_BLOCK + 8 * word + 8):
                        if flags[row, t]:
                            found[block, row] += _dot(read, weight, bias, row, t) > own[row]
    for row in range(rows):
        if targets[row] >= 0:
            ranks[row] += found[:, row].sum()
