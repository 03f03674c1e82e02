"""A pattern's score on text the run never mined (ffmem.engine.explanations).

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
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from ffmem.engine.explanations.fitting import MAX_PAIRS, MAX_TOKENS, START, Pattern, pair_code

MAX_LEVEL = MAX_TOKENS + MAX_PAIRS  # a position's match level: 0 none, then each token, then each pair
_ABSENT = torch.iinfo(torch.long).max  # a code no token or pair has: ends every sorted lookup


@dataclass
class PatternScore:
    """How well one pattern predicts its key on held-out positions (see the module docstring)."""

    correlation: float | None  # Pearson r of the match with sign · m; None: either never varies
    auroc: float | None  # the match telling apart positions where the key fires; None: it never fires
    positions: int  # held-out positions scored
    matches: int  # positions whose token or pair the pattern lists

    def details(self) -> dict:
        return {"positions": self.positions, "matches": self.matches, "auroc": self.auroc}


def lookup_rows(codes: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
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
        return cls.of_entries(codes, found, np.array([len(given) for given in levels], np.int64), device)

    @classmethod
    def of_entries(cls, codes: np.ndarray, found: np.ndarray, sizes: np.ndarray, device) -> _LevelTable:
        """The table of entries key after key: `codes` [entries] int64 and their levels `found` [entries]
        uint8, `sizes` [keys] how many each key has."""
        keys = np.repeat(np.arange(len(sizes)), sizes)  # [entries]
        order = np.argsort(codes, kind="stable")  # row after row, each row's keys in order
        distinct, counts = np.unique(codes, return_counts=True)  # [codes] each
        starts = np.concatenate([[0], np.cumsum(counts), [len(codes)]])  # the _ABSENT row is empty
        return cls(
            torch.tensor([*distinct.tolist(), _ABSENT], dtype=torch.long, device=device),
            torch.from_numpy(starts.astype(np.int64)).to(device),
            torch.from_numpy(keys[order].astype(np.int64)).to(device),
            torch.from_numpy(found[order]).to(device),
            len(sizes),
        )

    def __len__(self) -> int:
        return len(self.codes)

    def level(self, code: torch.Tensor) -> torch.Tensor:
        """Each code's level for every key: [Q, keys] uint8, 0 where the key's pattern does not hold it."""
        rows = lookup_rows(self.codes, code)  # [Q]
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
        self.values = torch.zeros(MAX_LEVEL + 1, len(patterns), dtype=torch.float64)  # [levels, keys], CPU
        tables = []
        for first, listed, weights in ((1, "final", "weights"), (1 + MAX_TOKENS, "pairs", "pair_weights")):
            lists = [getattr(p, listed) for p in patterns]  # [keys]
            sizes = np.fromiter(map(len, lists), np.int64, len(lists))  # [keys]
            entries = list(chain.from_iterable(lists))  # [entries]
            codes = np.array(entries, np.int64).reshape(len(entries), 1 if listed == "final" else 2)
            codes = codes[:, 0] if listed == "final" else pair_code(codes[:, 0], codes[:, 1])  # [entries]
            level = first + np.arange(len(codes)) - np.repeat(np.cumsum(sizes) - sizes, sizes)  # [entries]
            tables.append(_LevelTable.of_entries(codes, level.astype(np.uint8), sizes, device))
            found = np.fromiter(chain.from_iterable([getattr(p, weights) for p in patterns]), np.float64)
            keys = np.repeat(np.arange(len(patterns)), sizes)  # [entries]
            self.values[torch.from_numpy(level), torch.from_numpy(keys)] = torch.from_numpy(found)
        self.final, self.pairs = tables
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
        auroc = auroc_of_levels(self.levels[layer, 1], self.levels[layer, 0], value)  # [keys]
        return [
            PatternScore(
                correlation=_number(correlation[k]),
                auroc=_number(auroc[k]),
                positions=int(n),
                matches=int(matches[k]),
            )
            for k in range(p.shape[0])
        ]


def auroc_of_levels(positive: torch.Tensor, negative: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """AUROC of the match from its level counts among positives and negatives and each level's match
    ([levels, keys] each): P(match of a positive > match of a negative) + ½ P(equal). NaN without both.
    Each key's levels sorted by their match: the negatives below a level and those level with it are running
    sums read at the ends of its group of equal matches (counts and halves: the sums are exact)."""
    n_pos, n_neg = positive.sum(0), negative.sum(0)  # [keys]
    order = value.T.argsort(dim=1)  # [keys, levels]
    matches = value.T.gather(1, order).contiguous()  # [keys, levels], ascending
    negatives = negative.T.gather(1, order)  # [keys, levels]
    below = negatives.cumsum(dim=1)  # [keys, levels]
    below = torch.cat([torch.zeros_like(n_neg)[:, None], below], dim=1)  # [keys, 1 + levels]
    lower = below.gather(1, torch.searchsorted(matches, matches))  # [keys, levels]: negatives below
    level = below.gather(1, torch.searchsorted(matches, matches, right=True)) - lower  # level with it
    wins = (positive.T.gather(1, order) * (lower + level / 2)).sum(dim=1)  # [keys]
    return torch.where((n_pos > 0) & (n_neg > 0), wins / (n_pos * n_neg).clamp(min=1), torch.nan)


def _number(value: torch.Tensor) -> float | None:
    value = float(value)
    return None if math.isnan(value) else round(value, 4)
