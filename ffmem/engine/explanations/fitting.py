"""A memory's pattern, fitted on what the index holds about it (ffmem.engine.explanations).

**The pattern** (`fit_pattern`) is a token table fitted on what the index holds about a memory: the
coefficient at every token of its shaded sentences (its top triggers of each sign and its band samples:
ffmem.store.key_examples), never on held-out text. The memory's *sign* is the side of its larger
|coefficient| in the mined corpus (−1 where its strongest triggers are negative); the pattern predicts
sign · m. Each token's *weight* is its mean sign · m over the shaded positions it ends, shrunk towards the
mean of all of them by `PRIOR` positions' worth, less that mean: how far above (or below) the memory's
typical value the token puts it. The pattern keeps the `MAX_TOKENS` tokens that matter most — by their
count in the corpus × weight², those with at least `LEAST_IMPORTANCE` of the first's — and the
`MAX_PAIRS` (previous token, token) pairs whose own weight (shrunk towards their token's) differs most
from their token's, by the same measure.

A position's **match** is the weight of its pair (its token after the previous one) where the pattern
lists it, else the weight of its token, else 0: the sign · m it expects there, above the typical value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MAX_TOKENS, MAX_PAIRS = 64, 16  # tokens and (previous token, token) pairs a pattern weighs
PRIOR = 3.0  # shaded positions' worth of the memory's mean a weight is shrunk towards
LEAST_IMPORTANCE = 0.01  # a token or pair kept matters at least this share of the first (count × weight²)
START = -1  # the previous token of a sentence's first


@dataclass
class Pattern:
    """A memory's token table (see the module docstring)."""

    sign: int = 1  # +1: the pattern predicts m; −1: −m
    final: list[int] = field(default_factory=list)  # the position's token is one of these…
    weights: list[float] = field(default_factory=list)  # …and the match is its weight
    pairs: list[list[int]] = field(default_factory=list)  # [previous token (START: none), token]…
    pair_weights: list[float] = field(default_factory=list)  # …whose weight wins over the token's

    def to_dict(self) -> dict:
        """Its fields as plain lists (dataclasses.asdict deep-copies element by element: ~1 ms a pattern,
        most of describing a run's 46,080 memories)."""
        return {
            "sign": self.sign,
            "final": list(self.final),
            "weights": list(self.weights),
            "pairs": [list(pair) for pair in self.pairs],
            "pair_weights": list(self.pair_weights),
        }


@dataclass
class CorpusCounts:
    """How often each token and each (previous token, token) pair occurs in the mined corpus."""

    tokens: np.ndarray  # [vocab] int64
    pairs: np.ndarray  # [distinct pairs] int64 pair codes (pair_code), sorted
    pair_counts: np.ndarray  # [distinct pairs] int64

    @classmethod
    def of(cls, token_ids: Sequence[Sequence[int]], vocab_size: int) -> CorpusCounts:
        ids = [np.asarray(s, dtype=np.int64) for s in token_ids if len(s)]
        tokens = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        codes = np.concatenate([pair_code(previous_tokens(s), s) for s in ids]) if ids else tokens
        pairs, counts = np.unique(codes, return_counts=True)
        return cls(np.bincount(tokens, minlength=vocab_size), pairs, counts)

    def of_pairs(self, codes: np.ndarray) -> np.ndarray:
        """[codes] int64: each pair's count (0 where it never occurs)."""
        if not len(self.pairs):
            return np.zeros(len(codes), np.int64)
        row = np.searchsorted(self.pairs, codes).clip(max=len(self.pairs) - 1)
        return np.where(self.pairs[row] == codes, self.pair_counts[row], 0)


def previous_tokens(ids: np.ndarray) -> np.ndarray:
    """[len] each position's previous token, START at the first."""
    return np.concatenate([[START], ids[:-1]]).astype(np.int64)


def pair_code(previous, token):
    """One int64 for a (previous token, token) pair (START allowed), numpy or torch alike."""
    return (previous + 1) * 2**32 + token


def dominant_sign(largest: float | None, smallest: float | None) -> int:
    """A memory's sign from its largest and smallest coefficients in the mined corpus (None: unknown): −1
    where the smallest is negative and larger in size than the largest, else +1."""
    return -1 if smallest is not None and -smallest > (largest if largest is not None else 0.0) else 1


def _significant(value: float) -> float:
    return float(f"{value:.3g}")


def fit_pattern(
    tokens: np.ndarray, previous: np.ndarray, m: np.ndarray, sign: int, counts: CorpusCounts
) -> Pattern:
    """The pattern fitted on some mined positions of a memory: their tokens, previous tokens (START at a
    sentence's start) and coefficients ([positions] each), with the memory's sign and the corpus's counts."""
    if not len(m):
        return Pattern(sign=sign)
    m = sign * np.asarray(m, dtype=np.float64)  # [positions]
    mean = m.mean()
    distinct, row = np.unique(np.asarray(tokens, np.int64), return_inverse=True)  # [tokens], [positions]
    fitted = _shrunk(row, m, mean) - mean  # [tokens]
    final = _most_important(counts.tokens[distinct] * fitted**2, MAX_TOKENS)
    weights = np.zeros(len(distinct))  # [tokens] as the pattern has them: 0 where it lists none
    weights[final] = [_significant(w) for w in fitted[final]]
    codes, row = np.unique(pair_code(np.asarray(previous, np.int64), distinct[row]), return_inverse=True)
    alone = weights[np.searchsorted(distinct, codes % 2**32)]  # [pairs] their token's weight
    own = _shrunk(row, m, mean + alone) - mean  # [pairs]
    pairs = _most_important(counts.of_pairs(codes) * (own - alone) ** 2, MAX_PAIRS)
    return Pattern(
        sign=sign,
        final=distinct[final].tolist(),
        weights=weights[final].tolist(),
        pairs=[[int(c // 2**32) - 1, int(c % 2**32)] for c in codes[pairs]],
        pair_weights=[_significant(w) for w in own[pairs]],
    )


def _shrunk(row: np.ndarray, m: np.ndarray, towards) -> np.ndarray:
    """Each group's mean of m (`row`: each position's group), shrunk towards `towards` (per group or one
    value) by PRIOR positions' worth."""
    return (np.bincount(row, weights=m) + PRIOR * towards) / (np.bincount(row) + PRIOR)


def _most_important(importance: np.ndarray, most: int) -> np.ndarray:
    """The rows of the `most` largest importances, largest first (ties by row), that are above 0 and at
    least LEAST_IMPORTANCE of the largest."""
    order = np.argsort(-importance, kind="stable")[:most]
    if not len(order) or importance[order[0]] <= 0:
        return order[:0]
    return order[importance[order] >= LEAST_IMPORTANCE * importance[order[0]]]
