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
CHUNK = 2**15  # positions fitted together (their arrays stay in a cache)


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


def _significant(values: np.ndarray) -> np.ndarray:
    """Each value to 3 significant digits (as a person reads it: decimal rounding of the float), exactly
    float(f"{value:.3g}"): the value scaled to [100, 1000) by a power of ten (one correctly rounded product
    or quotient), rounded half to even, scaled back (one more: the nearest float to the decimal, as the
    text's parse gives it). A value whose scaled form lies within `_TIE` of a half (its rounding could
    differ from the exact decimal's), or too large or small for an exact power of ten, goes through the
    text."""
    values = np.asarray(values, dtype=np.float64)  # [n]
    found = values.copy()  # [n]: 0, ±inf and NaN as they are
    regular = np.isfinite(values) & (values != 0)  # [n]
    size = np.abs(values[regular])  # [r]
    k = 2 - np.floor(np.log10(size)).astype(np.int64)  # [r] the power of ten that scales to [100, 1000)
    k = k.clip(-_EXACT, _EXACT)
    scaled = _scaled(size, k)  # [r]
    k += (scaled < 100).astype(np.int64) - (scaled >= 1000)  # log10's last bit off at a power of ten
    exact = np.abs(k) <= _EXACT
    k = k.clip(-_EXACT, _EXACT)
    scaled = _scaled(size, k)  # [r]
    digits = np.rint(scaled)  # [r] half to even
    power = 10.0 ** np.abs(k)  # [r] exact
    rounded = np.where(k >= 0, digits / power, digits * power)  # [r]
    found[regular] = np.copysign(rounded, values[regular])
    doubtful = ~exact | (scaled < 100) | (scaled >= 1000) | (np.abs(scaled - np.floor(scaled) - 0.5) < _TIE)
    for at in np.flatnonzero(regular)[doubtful].tolist():
        found[at] = float(f"{values[at]:.3g}")
    return found


_EXACT = 22  # 10**22 is the largest power of ten a float64 holds exactly
_TIE = 1e-6  # a scaled value this near a half goes through the text (its error is below 1e-13)


def _scaled(size: np.ndarray, k: np.ndarray) -> np.ndarray:
    """size · 10**k, one correctly rounded operation (10**|k| is exact for |k| ≤ 22)."""
    power = 10.0 ** np.abs(k)
    with np.errstate(over="ignore", under="ignore"):  # out of range: sent through the text
        return np.where(k >= 0, size * power, size / power)


def fit_pattern(
    tokens: np.ndarray, previous: np.ndarray, m: np.ndarray, sign: int, counts: CorpusCounts
) -> Pattern:
    """The pattern fitted on some mined positions of a memory: their tokens, previous tokens (START at a
    sentence's start) and coefficients ([positions] each), with the memory's sign and the corpus's counts."""
    return fit_patterns(tokens, previous, m, [len(m)], [sign], counts)[0]


def fit_patterns(
    tokens: np.ndarray,
    previous: np.ndarray,
    m: np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    signs: Sequence[int] | np.ndarray,
    counts: CorpusCounts,
) -> list[Pattern]:
    """`fit_pattern` of many memories (or sides) at once: their positions one after another in tokens,
    previous tokens and coefficients ([positions] each), `lengths` [patterns] positions each, `signs`
    [patterns]. Each is fitted on its own positions alone, with the same sums in the same order."""
    lengths, signs = np.asarray(lengths, np.int64), np.asarray(signs, np.int64)  # [patterns] each
    tokens, previous = np.asarray(tokens, np.int64), np.asarray(previous, np.int64)  # [positions] each
    m = np.asarray(m, dtype=np.float64)  # [positions]
    ends = np.cumsum(lengths)  # [patterns]
    cuts = [0, *np.flatnonzero(np.diff(ends // CHUNK)) + 1, len(lengths)]  # patterns a chunk each
    found = []
    for first, last in zip(cuts[:-1], cuts[1:], strict=True):
        if first < last:
            start, end = ends[first] - lengths[first], ends[last - 1]
            chunk = (tokens[start:end], previous[start:end], m[start:end], lengths[first:last])
            found += _fit_chunk(*chunk, signs[first:last], counts)
    return found


def _fit_chunk(
    tokens: np.ndarray,
    previous: np.ndarray,
    m: np.ndarray,
    lengths: np.ndarray,
    signs: np.ndarray,
    counts: CorpusCounts,
) -> list[Pattern]:
    """`fit_patterns` of patterns whose positions fit in a cache (its arrays as it takes them)."""
    if not lengths.sum():
        return [Pattern(sign=sign) for sign in signs.tolist()]
    segment = np.repeat(np.arange(len(lengths)), lengths)  # [positions] each position's pattern
    m = signs[segment] * np.asarray(m, dtype=np.float64)  # [positions]
    # [patterns] each one's ndarray.mean, its positions summed pairwise (np.add.reduceat sums otherwise)
    ends = np.cumsum(lengths).tolist()
    mean = np.array(
        [m[end - n : end].mean() if n else 0.0 for end, n in zip(ends, lengths.tolist(), strict=True)]
    )
    # one sort by (pattern, token, previous token): each token's and each pair's positions run together
    width = max(len(counts.tokens), int(tokens.max(initial=0)) + 1)
    key = (segment * width + tokens) * (width + 1) + previous + 1  # [positions]
    order = np.argsort(key)  # [positions] (any order of equal keys: the sums are taken in the positions')
    ordered = key[order]  # [positions]
    pair_start = np.r_[True, ordered[1:] != ordered[:-1]]  # [positions] in sorted order: a pair's first
    token_start = pair_start.copy()  # … a token's first (the previous token aside)
    token_start[1:] &= (ordered[1:] - previous[order[1:]]) != (ordered[:-1] - previous[order[:-1]])
    token_row = _groups(order, token_start)  # [positions] each one's (pattern, token) group
    row = _groups(order, pair_start)  # [positions] each one's (pattern, previous token, token) group
    firsts = order[token_start]  # [groups] a position of each (pattern, token), in their order
    group_pattern, group_token = segment[firsts], tokens[firsts]  # [groups] each
    # tokens (the sums of m in the positions' order: as the memory's own bincount adds them)
    fitted = _shrunk(token_row, m, mean[group_pattern]) - mean[group_pattern]  # [groups]
    final = _most_important(counts.tokens[group_token] * fitted**2, group_pattern, MAX_TOKENS)  # [kept]
    weights = np.zeros(len(firsts))  # [groups] as the patterns have them: 0 where one lists none
    weights[final] = _significant(fitted[final])
    # pairs
    firsts = order[pair_start]  # [pairs] a position of each (pattern, previous token, token)
    pair_pattern, pair_codes = segment[firsts], pair_code(previous[firsts], tokens[firsts])  # [pairs] each
    alone = weights[token_row[firsts]]  # [pairs] their token's weight
    own = _shrunk(row, m, mean[pair_pattern] + alone) - mean[pair_pattern]  # [pairs]
    importance = counts.of_pairs(pair_codes) * (own - alone) ** 2  # [pairs]
    chosen = _most_important(importance, pair_pattern, MAX_PAIRS, tie=pair_codes)  # ties: by pair code
    return _patterns(
        signs,
        group_pattern[final],
        group_token[final],
        weights[final],
        pair_pattern[chosen],
        pair_codes[chosen],
        _significant(own[chosen]),
        lengths,
    )


def _patterns(signs, token_pattern, token, weight, pair_pattern, pair, pair_weight, lengths) -> list[Pattern]:
    """The patterns from their kept tokens and pairs (each [kept], grouped by pattern, in order)."""
    token_ends = np.searchsorted(token_pattern, np.arange(len(signs)), side="right").tolist()
    pair_ends = np.searchsorted(pair_pattern, np.arange(len(signs)), side="right").tolist()
    token, weight, pair_weight = token.tolist(), weight.tolist(), pair_weight.tolist()
    pair = np.stack([pair // 2**32 - 1, pair % 2**32], axis=1).tolist()  # [kept, 2]
    found, token_start, pair_start = [], 0, 0
    for sign, token_end, pair_end in zip(signs.tolist(), token_ends, pair_ends, strict=True):
        found.append(
            Pattern(
                sign=sign,
                final=token[token_start:token_end],
                weights=weight[token_start:token_end],
                pairs=pair[pair_start:pair_end],
                pair_weights=pair_weight[pair_start:pair_end],
            )
        )
        token_start, pair_start = token_end, pair_end
    return found


def _shrunk(row: np.ndarray, m: np.ndarray, towards) -> np.ndarray:
    """Each group's mean of m (`row`: each position's group), shrunk towards `towards` (per group or one
    value) by PRIOR positions' worth."""
    return (np.bincount(row, weights=m) + PRIOR * towards) / (np.bincount(row) + PRIOR)


def _groups(order: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Each row's group (0, 1, …), the rows sorted by `order` and `starts` [rows] marking where each group
    begins in that order, put back in the rows' own order."""
    group = np.empty(len(order), np.int64)
    group[order] = np.cumsum(starts) - 1
    return group


def _most_important(
    importance: np.ndarray, pattern: np.ndarray, most: int, tie: np.ndarray | None = None
) -> np.ndarray:
    """Per pattern (`pattern`: each row's, ascending), the rows of its `most` largest importances, largest
    first (ties by `tie`, else by row), that are above 0 and at least LEAST_IMPORTANCE of its largest:
    [kept], grouped by pattern. (Those below that share come after every one kept: left out before the
    sort.)"""
    if not len(importance):
        return np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, pattern[1:] != pattern[:-1]])  # [present patterns]
    largest = np.maximum.reduceat(importance, starts)  # [present patterns]
    largest = np.repeat(largest, np.diff(np.r_[starts, len(pattern)]))  # [rows] its pattern's largest
    candidates = np.flatnonzero((largest > 0) & (importance >= LEAST_IMPORTANCE * largest))  # [c]
    ties = candidates if tie is None else tie[candidates]  # [c]
    order = candidates[np.lexsort((ties, -importance[candidates], pattern[candidates]))]  # [c]
    ordered = pattern[order]  # [c] ascending
    index = np.arange(len(order))  # [c]
    begins = np.r_[True, ordered[1:] != ordered[:-1]][: len(order)]  # [c]: a pattern's first
    rank = index - np.maximum.accumulate(np.where(begins, index, 0))  # [c] within its pattern
    return order[rank < most]
