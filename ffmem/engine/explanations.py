"""Explanations without an API key: a short description of each memory read off its index, and a score
for how well that description predicts the key on text the run never mined.

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

**The description** (`describe`) names the pattern, each weight in m's units (sign · weight, to three
significant digits as stored): where the memory is strongest (m > 0, or m < 0 for sign −1: the tokens
that move it furthest that way), the pairs ("after “ of”: “ Paris” +1.2"), the tokens that move it the
opposite way, how many more it weighs; then its value's top tokens (what it promotes) and its
shallowness where the analyses measured it.

**The score** (`PatternScores`) is the Pearson correlation, over every position of the held-out
sentences (from the first mined position on, never position 0), between the match and sign · m there:
1 when the coefficient rises exactly with the pattern, 0 when the pattern tells nothing. It is the
"simulate and score" of automatic interpretability with the token table as the simulator. Kept beside
it (`details`): the positions, how many the pattern lists a token or pair of, and the AUROC of the
match for telling apart the positions where the key *fires* (sign · m ≥ half its largest on that side
in the mined corpus) from the rest (0.5: chance; ties count half), None where it never fires there, as
Neuronpedia's detection scorers rank firing against not. Both are computed in one pass from running
sums, one layer's coefficients at a time, so no [positions, memories] matrix is ever held.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ffmem.engine.values.token_display import visible

MAX_TOKENS, MAX_PAIRS = 64, 16  # tokens and (previous token, token) pairs a pattern weighs
PRIOR = 3.0  # shaded positions' worth of the memory's mean a weight is shrunk towards
LEAST_IMPORTANCE = 0.01  # a token or pair kept matters at least this share of the first (count × weight²)
SHOWN_RAISE, SHOWN_LOWER, SHOWN_PAIRS = 6, 3, 3  # tokens and pairs the description names
VALUE_TOKENS = 3  # promoted tokens named in the description
MAX_LEVEL = MAX_TOKENS + MAX_PAIRS  # a position's match level: 0 none, then each token, then each pair
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
class Description:
    text: str
    pattern: Pattern


@dataclass
class PatternScore:
    """How well one pattern predicts its key on held-out positions (see the module docstring)."""

    correlation: float | None  # Pearson r of the match with sign · m; None: either never varies
    auroc: float | None  # the match telling apart positions where the key fires; None: it never fires
    positions: int  # held-out positions scored
    matches: int  # positions whose token or pair the pattern lists

    def details(self) -> dict:
        return {"positions": self.positions, "matches": self.matches, "auroc": self.auroc}


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


def quoted(text: str) -> str:
    """A token as the description names it: in quotes, made visible as on every page (↵, ⇥, ⟨U+200B⟩,
    ∅; ffmem.engine.values.token_display) but for its spaces, which the quotes show."""
    return "“" + visible(text, spaces=False) + "”"


def describe(
    pattern: Pattern, value_tokens: Sequence[int], shallowness: float | None, texts: Sequence[str]
) -> Description:
    """A memory's description: its pattern, its value's top tokens (strongest first) and its shallowness
    (or None); `texts` names every token id (as the pages do: a byte-level token as its bytes, ⟨0x80⟩)."""
    weighed = sorted(zip(pattern.weights, pattern.final, strict=True), key=lambda item: (-item[0], item[1]))
    raise_, lower = [i for i in weighed if i[0] > 0], [i for i in weighed[::-1] if i[0] < 0]
    pairs = sorted(
        zip(pattern.pair_weights, pattern.pairs, strict=True), key=lambda item: (-abs(item[0]), item[1])
    )

    def named(items) -> str:  # each weight in m's units: sign · weight
        return ", ".join(f"{quoted(texts[t])} {pattern.sign * w:+.3g}" for w, t in items)

    parts = []
    if raise_:
        parts.append(f"strongest (m {'>' if pattern.sign > 0 else '<'} 0) at " + named(raise_[:SHOWN_RAISE]))
    for weight, (before, token) in pairs[:SHOWN_PAIRS]:
        after = "the start" if before == START else quoted(texts[before])
        parts.append(f"after {after}: {named([(weight, token)])}")
    if lower:
        parts.append("opposite at " + named(lower[:SHOWN_LOWER]))
    more = sum(
        max(0, len(items) - shown)
        for items, shown in ((raise_, SHOWN_RAISE), (lower, SHOWN_LOWER), (pairs, SHOWN_PAIRS))
    )
    if more:
        parts.append(f"{more} more weighed")
    if not parts:
        parts.append("no token sets it apart in its shaded sentences")
    if value_tokens:
        parts.append("promotes " + ", ".join(quoted(texts[t]) for t in list(value_tokens)[:VALUE_TOKENS]))
    if shallowness is not None:
        parts.append(f"{'shallow' if shallowness >= 0.5 else 'semantic'} (shallowness {shallowness:.2f})")
    return Description(text="; ".join(parts), pattern=pattern)


# ---- scoring on held-out text -------------------------------------------------------------------

_ABSENT = torch.iinfo(torch.long).max  # a code no token or pair has: ends every sorted lookup


def _lookup(codes: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The row of each value in `codes` (sorted, ending in _ABSENT), and the last row where absent."""
    last = len(codes) - 1
    row = torch.searchsorted(codes, values).clamp_(max=last)
    return torch.where(codes[row] == values, row, last)


@dataclass(frozen=True)
class _LevelTable:
    """A lookup from a code (a token, or a pair's code) to the level it gives each key, in compressed rows:
    only the (key, level) entries some pattern holds, ≤ MAX_TOKENS (or MAX_PAIRS) a key. A dense [codes,
    keys] table would grow with the distinct tokens of a layer's patterns times its keys: ~0.2 GB a layer
    at 8,192 keys over the whole corpus, its pairs twice that, every layer at once while scoring."""

    codes: torch.Tensor  # [codes + 1] every code some key weighs, sorted, ending in _ABSENT
    starts: torch.Tensor  # [codes + 2]: row r's entries are [starts[r], starts[r + 1])
    keys: torch.Tensor  # [entries] the key of each entry, row after row
    levels: torch.Tensor  # [entries] uint8: the level the row's code gives that key
    n_keys: int

    @classmethod
    def of(cls, levels: Sequence[dict[int, int]], device) -> _LevelTable:
        """The table of `levels[key]` (code → level)."""
        codes = np.array([code for given in levels for code in given], dtype=np.int64)  # [entries]
        found = np.array([level for given in levels for level in given.values()], dtype=np.uint8)  # [entries]
        keys = np.repeat(np.arange(len(levels)), [len(given) for given in levels])  # [entries]
        order = np.argsort(codes, kind="stable")  # row after row, each row's keys in order
        distinct, counts = np.unique(codes, return_counts=True)  # [codes] each
        starts = np.concatenate([[0], np.cumsum(counts), [len(codes)]])  # the _ABSENT row is empty
        return cls(
            torch.tensor([*distinct.tolist(), _ABSENT], dtype=torch.long, device=device),
            torch.from_numpy(starts.astype(np.int64)).to(device),
            torch.from_numpy(keys[order].astype(np.int64)).to(device),
            torch.from_numpy(found[order]).to(device),
            len(levels),
        )

    def __len__(self) -> int:
        return len(self.codes)

    def level(self, code: torch.Tensor) -> torch.Tensor:
        """Each code's level for every key: [Q, keys] uint8, 0 where the key's pattern does not hold it."""
        rows = _lookup(self.codes, code)  # [Q]
        first, counts = self.starts[rows], self.starts[rows + 1] - self.starts[rows]  # [Q] each
        found = torch.zeros(len(code), self.n_keys, dtype=torch.uint8, device=code.device)  # [Q, keys]
        total = int(counts.sum())
        if total:
            position = torch.repeat_interleave(counts, output_size=total)  # [entries]: its row of `code`
            begun = counts.cumsum(0) - counts  # [Q] where each position's entries start among them all
            entry = first[position] + torch.arange(total, device=code.device) - begun[position]  # [entries]
            found[position, self.keys[entry]] = self.levels[entry]
        return found


class LayerPatterns:
    """The patterns of one layer's keys as lookup tables, for matching every key at once.

    A position's *level* for a key names its match: 0 none, 1 + i the pattern's i-th token, 1 + MAX_TOKENS
    + i its i-th pair. The position's token picks the row of `final` that holds each key's token level,
    its pair (the previous token, START at a sentence's start, then it) the row of `pairs`, which wins
    where it is not 0. `values` [levels, keys] holds each level's match, `sign` [keys] each key's sign.
    """

    def __init__(self, patterns: Sequence[Pattern], device: torch.device | str = "cpu"):
        self.final = _LevelTable.of(
            [{token: 1 + i for i, token in enumerate(p.final)} for p in patterns], device
        )
        self.pairs = _LevelTable.of(
            [{pair_code(*pair): 1 + MAX_TOKENS + i for i, pair in enumerate(p.pairs)} for p in patterns],
            device,
        )
        self.values = torch.zeros(MAX_LEVEL + 1, len(patterns), dtype=torch.float64)  # [levels, keys], CPU
        for key, p in enumerate(patterns):
            self.values[1 : 1 + len(p.weights), key] = torch.tensor(p.weights, dtype=torch.float64)
            pairs = slice(1 + MAX_TOKENS, 1 + MAX_TOKENS + len(p.pair_weights))
            self.values[pairs, key] = torch.tensor(p.pair_weights, dtype=torch.float64)
        self.sign = torch.tensor([float(p.sign) for p in patterns], device=device)  # [keys]

    def match(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Each valid position's level for each key: [Q, keys] uint8, the positions being
        `input_ids[valid]` ([batch, pos] each, one sentence a row from its start)."""
        rows, positions = valid.nonzero(as_tuple=True)  # [Q] each, in the order of input_ids[valid]
        token = input_ids[rows, positions]  # [Q]
        level = self.final.level(token)  # [Q, keys]
        if len(self.pairs) > 1:
            previous = torch.where(positions > 0, input_ids[rows, (positions - 1).clamp(min=0)], START)  # [Q]
            pair = self.pairs.level(pair_code(previous, token))  # [Q, keys]
            level = torch.where(pair > 0, pair, level)
        return level


class PatternScores:
    """Running sums for the score of every key's pattern over held-out positions (module docstring):
    per layer, the positions, how many of them are at each level where the key fires and where it does
    not, Σ sign · m by level and Σ m²; the correlation's sums follow from them and the levels' values.

    `update(layer, coefficients, input_ids, valid)` with one batch's [batch, pos, keys] coefficients;
    `scores(layer)` gives each key's PatternScore.
    """

    def __init__(self, patterns: Sequence[Sequence[Pattern]], fires_at: torch.Tensor, device="cpu"):
        """`patterns[layer][key]`; `fires_at` [layers, keys]: the sign · m from which a key fires (NaN:
        never)."""
        self.layers = [LayerPatterns(layer, device) for layer in patterns]
        self.fires_at = fires_at.to(device)
        n_layers, n_keys = fires_at.shape
        self.key_index = torch.arange(n_keys, dtype=torch.int32, device=device)
        self.n = torch.zeros(n_layers, dtype=torch.float64)
        self.levels = torch.zeros(n_layers, 2, MAX_LEVEL + 1, n_keys, dtype=torch.float64)  # [fires?, level]
        self.m_sums = torch.zeros(n_layers, MAX_LEVEL + 1, n_keys, dtype=torch.float64)  # Σ sign · m by level
        self.m_squares = torch.zeros(n_layers, n_keys, dtype=torch.float64)  # Σm²

    def update(self, layer: int, coefficients: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor):
        patterns = self.layers[layer]
        level = patterns.match(input_ids, valid)  # [Q, keys] uint8
        m = coefficients[valid] * patterns.sign  # [Q, keys] sign · m
        fires = m >= self.fires_at[layer][None]  # [Q, keys] (NaN thresholds: never)
        n_keys, levels = m.shape[1], MAX_LEVEL + 1
        # one bin per key, fired or not and level: (fires · levels + level) · keys + key
        bins = torch.add(level, fires, alpha=levels).int().mul_(n_keys).add_(self.key_index).view(-1)
        m = m.double()
        counts = torch.bincount(bins, minlength=2 * levels * n_keys).view(2, levels, n_keys)
        sums = torch.bincount(bins, weights=m.view(-1), minlength=2 * levels * n_keys).view(2, levels, n_keys)
        self.n[layer] += m.shape[0]
        self.levels[layer] += counts.cpu()
        self.m_sums[layer] += sums.sum(0).cpu()
        self.m_squares[layer] += (m.mul_(m).T @ m.new_ones(m.shape[0])).cpu()

    def scores(self, layer: int) -> list[PatternScore]:
        n = self.n[layer].item()
        if n == 0:
            return [PatternScore(None, None, 0, 0) for _ in range(self.m_squares.shape[1])]
        value = self.layers[layer].values  # [levels, keys]
        positions = self.levels[layer].sum(0)  # [levels, keys]
        p, p2 = (positions * value).sum(0), (positions * value * value).sum(0)
        m, m2, pm = self.m_sums[layer].sum(0), self.m_squares[layer], (self.m_sums[layer] * value).sum(0)
        matches = positions[1:].sum(0)
        var_p = (p2 / n - (p / n) ** 2).clamp(min=0)
        var_m = (m2 / n - (m / n) ** 2).clamp(min=0)
        covariance = pm / n - (p / n) * (m / n)
        defined = (var_p > 1e-12) & (var_m > 1e-12)
        correlation = torch.where(defined, covariance / (var_p * var_m).sqrt().clamp(min=1e-30), torch.nan)
        auroc = _auroc(self.levels[layer, 1], self.levels[layer, 0], value)  # [keys]
        return [
            PatternScore(
                correlation=_number(correlation[k]),
                auroc=_number(auroc[k]),
                positions=int(n),
                matches=int(matches[k]),
            )
            for k in range(p.shape[0])
        ]


def _auroc(positive: torch.Tensor, negative: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """AUROC of the match from its level counts among positives and negatives and each level's match
    ([levels, keys] each): P(match of a positive > match of a negative) + ½ P(equal). NaN without both."""
    n_pos, n_neg = positive.sum(0), negative.sum(0)  # [keys]
    wins = torch.zeros_like(n_pos)
    for keys in torch.arange(len(n_pos)).split(512):  # [levels, levels, 512] at a time
        beats = (torch.sign(value[:, None, keys] - value[None, :, keys]) + 1) / 2  # 1, ½ or 0
        wins[keys] = torch.einsum("ak,abk,bk->k", positive[:, keys], beats, negative[:, keys])
    return torch.where((n_pos > 0) & (n_neg > 0), wins / (n_pos * n_neg).clamp(min=1), torch.nan)


def _number(value: torch.Tensor) -> float | None:
    value = float(value)
    return None if math.isnan(value) else round(value, 4)
