"""Explanations without an API key: a short description of each memory read off its index, and a score
for how well that description predicts the key on text the run never mined.

**The description** (`describe`) comes from what the index holds about a memory:
- how its top positive trigger prefixes end: the final tokens that end at least `FINAL_SHARE` of them
  (at most `MAX_FINAL`), and the commonest final n-gram (2–4 tokens) that at least `NGRAM_SHARE` share;
- the words that set its prefixes apart from the corpus: tokens (with a letter or digit) before the
  trigger in at least `CONTEXT_SHARE` of its prefixes and at least `CONTEXT_LIFT` times as often as in
  the corpus's sentences, by share × log(lift) (at most `MAX_CONTEXT`);
- its value's top tokens (what it promotes) and its shallowness where the analyses measured it.

**The pattern** is the input side of the description, three parts a position may match: its token is
one of the final tokens; the tokens ending there are the n-gram; one of the context words occurs in
the sentence up to there. A position's *match* is the share of the description's parts it matches
(0, ⅓, ½, ⅔ or 1; a pattern with no parts matches nothing).

**The score** (`PatternScores`) is the Pearson correlation, over every position of the held-out
sentences (from the first mined position on, never position 0), between the match and the key's
coefficient m there: 1 when m rises exactly with the pattern, 0 when the pattern tells nothing. It is
the "simulate and score" of automatic interpretability with the pattern as the simulator. Kept beside
it (`details`): the positions, how many matched at all, and the AUROC of the match for telling apart
the positions where the key *fires* (m ≥ half its largest coefficient in the mined corpus) from the
rest (0.5: chance), None where it never fires there. Both are computed in one pass from running sums,
one layer's coefficients at a time, so no [positions, memories] matrix is ever held.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import chain

import numpy as np
import torch

from ffmem.engine.token_display import visible

FINAL_SHARE, MAX_FINAL = 0.1, 3
NGRAM_SHARE, LONGEST = 0.2, 4
CONTEXT_SHARE, CONTEXT_LIFT, MAX_CONTEXT = 0.3, 3.0, 3
MIN_TRIGGERS = 2  # a final token, n-gram or context word must be shared by at least this many prefixes
MAX_LEVEL = 3  # parts a pattern may have
VALUE_TOKENS = 3  # promoted tokens named in the description


@dataclass
class Pattern:
    """The token ids a description's pattern matches (see the module docstring)."""

    final: list[int] = field(default_factory=list)  # the position's token is one of these
    ngram: list[int] = field(default_factory=list)  # the tokens ending at the position (≥ 2, or none)
    context: list[int] = field(default_factory=list)  # one of these occurs in the sentence up to it

    @property
    def parts(self) -> int:
        return bool(self.final) + bool(self.ngram) + bool(self.context)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Description:
    text: str
    pattern: Pattern


@dataclass
class PatternScore:
    """How well one pattern predicts its key on held-out positions (see the module docstring)."""

    correlation: float | None  # Pearson r of the match with m; None: the match or m never varies
    auroc: float | None  # the match telling apart positions where the key fires; None: it never fires
    positions: int  # held-out positions scored
    matches: int  # positions the pattern matched at least in part

    def details(self) -> dict:
        return {"positions": self.positions, "matches": self.matches, "auroc": self.auroc}


def document_frequency(token_ids: Sequence[Sequence[int]], vocab_size: int) -> np.ndarray:
    """The share of sentences that contain each token: [vocab] float64."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids in token_ids:
        counts[np.unique(np.asarray(ids, dtype=np.int64))] += 1
    return counts / max(1, len(token_ids))


def word_like(texts: Sequence[str]) -> np.ndarray:
    """Which tokens may be named as context words: those with a letter or a digit. [vocab] bool."""
    return np.array([any(ch.isalnum() for ch in text) for text in texts], dtype=bool)


def find_pattern(
    prefixes: Sequence[Sequence[int]], frequency: np.ndarray, words: np.ndarray
) -> tuple[Pattern, dict[str, list[float]]]:
    """The pattern of a key's top trigger prefixes (token ids up to and including the trigger token,
    the strongest first) and the share of prefixes each part holds for: (pattern, {"final": [share per
    token], "ngram": [share], "context": [share per word]})."""
    prefixes = [list(ids) for ids in prefixes if len(ids)]
    if not prefixes:
        return Pattern(), {"final": [], "ngram": [], "context": []}
    total = len(prefixes)
    finals = [
        (token, count)
        for token, count in Counter(ids[-1] for ids in prefixes).most_common(MAX_FINAL)
        if count >= MIN_TRIGGERS and count / total >= FINAL_SHARE
    ]
    ngram, ngram_count = [], 0
    for n in range(2, LONGEST + 1):  # the longer one when it is as common
        grams = Counter(tuple(ids[-n:]) for ids in prefixes if len(ids) >= n)
        if grams:
            gram, count = min(grams.items(), key=lambda item: (-item[1], item[0]))
            if count >= max(MIN_TRIGGERS, ngram_count, NGRAM_SHARE * total):
                ngram, ngram_count = list(gram), count
    final_ids = {token for token, _ in finals}
    seen = Counter(chain.from_iterable(set(ids[:-1]) for ids in prefixes))  # prefixes holding each token
    least = max(MIN_TRIGGERS, CONTEXT_SHARE * total)
    context = []
    for token in [token for token, count in seen.items() if count >= least]:
        share = seen[token] / total
        lift = share / max(float(frequency[token]), 1.0 / len(frequency))
        if lift >= CONTEXT_LIFT and words[token] and token not in final_ids:
            context.append((share * math.log(lift), token, share))
    context.sort(key=lambda item: (-item[0], item[1]))
    context = context[:MAX_CONTEXT]
    pattern = Pattern(
        final=[token for token, _ in finals], ngram=ngram, context=[token for _, token, _ in context]
    )
    shares = {
        "final": [count / total for _, count in finals],
        "ngram": [ngram_count / total] if ngram else [],
        "context": [share for _, _, share in context],
    }
    return pattern, shares


def quoted(text: str) -> str:
    """A token as the description names it: in quotes, made visible as on every page (↵, ⇥, ⟨U+200B⟩,
    ∅; ffmem.engine.token_display) but for its spaces, which the quotes show."""
    return "“" + visible(text, spaces=False) + "”"


def describe(
    prefixes: Sequence[Sequence[int]],
    value_tokens: Sequence[int],
    shallowness: float | None,
    frequency: np.ndarray,
    words: np.ndarray,
    texts: Sequence[str],
) -> Description:
    """A memory's description from its top trigger prefixes (strongest first), its value's top tokens
    (strongest first), its shallowness (or None) and the corpus's `document_frequency`; `texts` names
    every token id (as the pages do: a byte-level token as its bytes, ⟨0x80⟩)."""
    pattern, shares = find_pattern(prefixes, frequency, words)
    parts = []
    if pattern.final:
        named = [f"{quoted(texts[t])} {s:.0%}" for t, s in zip(pattern.final, shares["final"], strict=True)]
        parts.append("ends in " + ", ".join(named))
    if pattern.ngram:
        parts.append(f"ends with {quoted(''.join(texts[t] for t in pattern.ngram))} {shares['ngram'][0]:.0%}")
    if pattern.context:
        parts.append("after " + ", ".join(quoted(texts[t]) for t in pattern.context))
    if not parts:
        parts.append("no shared ending or word among its top triggers")
    if value_tokens:
        parts.append("promotes " + ", ".join(quoted(texts[t]) for t in list(value_tokens)[:VALUE_TOKENS]))
    if shallowness is not None:
        parts.append(f"{'shallow' if shallowness >= 0.5 else 'semantic'} (shallowness {shallowness:.2f})")
    return Description(text="; ".join(parts), pattern=pattern)


# ---- scoring on held-out text -------------------------------------------------------------------

_ABSENT = torch.iinfo(torch.long).max  # a code no token, n-gram or word has: ends every sorted lookup


def _lookup(codes: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The row of each value in `codes` (sorted, ending in _ABSENT), and the last row where absent."""
    last = len(codes) - 1
    row = torch.searchsorted(codes, values).clamp_(max=last)
    return torch.where(codes[row] == values, row, last)


def _table(codes: Iterable[int], keys: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """A lookup table: (`codes` sorted and ending in _ABSENT, [codes + 1, keys] uint8: 1 where the
    code's row is among `keys[key]`, the codes each key matches; the _ABSENT row matches no key)."""
    codes = sorted(codes)
    row = {code: i for i, code in enumerate(codes)}
    marked = [(row[code], key) for key, matched in enumerate(keys) for code in matched]
    table = torch.zeros(len(codes) + 1, len(keys), dtype=torch.uint8)
    table[[r for r, _ in marked], [key for _, key in marked]] = 1
    return torch.tensor([*codes, _ABSENT], dtype=torch.long, device=device), table.to(device)


class LayerPatterns:
    """The patterns of one layer's keys as lookup tables, for matching every key at once.

    A position's token picks the row of `final` that marks the keys it ends. Its n-gram parts walk a
    trie of the n-grams read backwards: the token j − 1 before the position (−2 before the sentence's
    start) extends the state reached at j − 1 tokens, and `ngrams[j − 1]` marks the keys whose n-gram
    of j tokens that state spells. A key's context part matches from the first position in the
    sentence where one of its words occurs.
    """

    def __init__(self, patterns: Sequence[Pattern], device: torch.device | str = "cpu"):
        self.final_codes, self.final = _table(
            {t for p in patterns for t in p.final}, [p.final for p in patterns], device
        )
        # the trie's codes: state · (width + 1) + token, a token ≥ width (none of an n-gram's) as width
        self.width = max((t + 1 for p in patterns for t in p.ngram), default=0)
        self.ngrams, state = [], {(): 0}
        for length in range(1, max((len(p.ngram) for p in patterns), default=0) + 1):
            spelled = sorted({tuple(p.ngram[::-1][:length]) for p in patterns if len(p.ngram) >= length})
            code = {s: state[s[:-1]] * (self.width + 1) + s[-1] for s in spelled}
            self.ngrams.append(
                _table(
                    code.values(),
                    [[code[tuple(p.ngram[::-1])]] if len(p.ngram) == length else [] for p in patterns],
                    device,
                )
            )
            state = {s: i for i, s in enumerate(sorted(spelled, key=code.get))}  # a state: its code's row
        self.context_words = sorted({t for p in patterns for t in p.context})
        column = {token: i for i, token in enumerate(self.context_words)}
        words = len(self.context_words)  # the column of no word
        self.context_codes = torch.tensor([*self.context_words, _ABSENT], dtype=torch.long, device=device)
        self.context = torch.tensor(  # [keys, MAX_CONTEXT] the columns of each key's words
            [[column[t] for t in p.context] + [words] * (MAX_CONTEXT - len(p.context)) for p in patterns],
            dtype=torch.long,
            device=device,
        ).view(len(patterns), MAX_CONTEXT)
        parts = torch.tensor([p.parts for p in patterns], dtype=torch.float32)  # [keys]
        # [levels, keys] on the CPU: the match share of each number of parts matched, divided in float32
        self.share = (torch.arange(MAX_LEVEL + 1, dtype=torch.float32)[:, None] / parts.clamp(min=1)).double()

    def match(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """How many parts of each key's pattern each valid position matches: [Q, keys] uint8, the
        positions being `input_ids[valid]` ([batch, pos] each, one sentence a row from its start)."""
        batch, width = input_ids.shape
        rows, positions = valid.nonzero(as_tuple=True)  # [Q] each, in the order of input_ids[valid]
        count = self.final.index_select(0, _lookup(self.final_codes, input_ids[rows, positions]))  # [Q, keys]
        state = None
        for back, (codes, table) in enumerate(self.ngrams):
            before = positions - back
            token = torch.where(before >= 0, input_ids[rows, before.clamp(min=0)], -2)
            token = torch.where((token >= 0) & (token < self.width), token, self.width)
            state = _lookup(codes, token if state is None else state * (self.width + 1) + token)
            count += table.index_select(0, state)
        if self.context_words:
            pos = torch.arange(width, device=input_ids.device)
            word = _lookup(self.context_codes, input_ids)  # [batch, pos] its column; len(context_words): none
            first = torch.full((batch, len(self.context_words) + 1), width, device=input_ids.device)
            first.scatter_reduce_(1, word, pos.expand(batch, -1), "amin")  # [batch, words + 1]
            first[:, -1] = width  # no word never occurs
            since = first[:, self.context[:, 0]]  # [batch, keys]: where one of a key's words first occurs
            for columns in self.context[:, 1:].T:
                since = torch.minimum(since, first[:, columns])
            count += (since[:, None, :] <= pos[:, None])[valid]
        return count


class PatternScores:
    """Running sums for the score of every key's pattern over held-out positions (module docstring):
    per layer, the positions, how many of them match each number of parts where the key fires and
    where it does not, and Σm and Σm² by number of parts; the correlation's sums follow from them.

    `update(layer, coefficients, input_ids, valid)` with one batch's [batch, pos, keys] coefficients;
    `scores(layer)` gives each key's PatternScore.
    """

    def __init__(self, patterns: Sequence[Sequence[Pattern]], fires_at: torch.Tensor, device="cpu"):
        """`patterns[layer][key]`; `fires_at` [layers, keys]: the coefficient from which a key fires
        (NaN: never)."""
        self.layers = [LayerPatterns(layer, device) for layer in patterns]
        self.fires_at = fires_at.to(device)
        n_layers, n_keys = fires_at.shape
        self.key_index = torch.arange(n_keys, dtype=torch.int32, device=device)
        self.n = torch.zeros(n_layers, dtype=torch.float64)
        self.levels = torch.zeros(n_layers, 2, MAX_LEVEL + 1, n_keys, dtype=torch.float64)  # [fires?, parts]
        self.m_sums = torch.zeros(n_layers, MAX_LEVEL + 1, n_keys, dtype=torch.float64)  # Σm by parts
        self.m_squares = torch.zeros(n_layers, n_keys, dtype=torch.float64)  # Σm²

    def update(self, layer: int, coefficients: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor):
        parts = self.layers[layer].match(input_ids, valid)  # [Q, keys] uint8
        m = coefficients[valid]  # [Q, keys]
        fires = m >= self.fires_at[layer][None]  # [Q, keys] (NaN thresholds: never)
        n_keys, levels = m.shape[1], MAX_LEVEL + 1
        # one bin per key, fired or not and parts matched: (fires · levels + parts) · keys + key
        bins = torch.add(parts, fires, alpha=levels).int().mul_(n_keys).add_(self.key_index).view(-1)
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
        share = self.layers[layer].share  # [levels, keys]
        positions = self.levels[layer].sum(0)  # [levels, keys]
        p, p2 = (positions * share).sum(0), (positions * share * share).sum(0)
        m, m2, pm = self.m_sums[layer].sum(0), self.m_squares[layer], (self.m_sums[layer] * share).sum(0)
        matches = positions[1:].sum(0)
        var_p = (p2 / n - (p / n) ** 2).clamp(min=0)
        var_m = (m2 / n - (m / n) ** 2).clamp(min=0)
        covariance = pm / n - (p / n) * (m / n)
        defined = (var_p > 1e-12) & (var_m > 1e-12)
        correlation = torch.where(defined, covariance / (var_p * var_m).sqrt().clamp(min=1e-30), torch.nan)
        auroc = _auroc(self.levels[layer, 1], self.levels[layer, 0])  # [keys]
        return [
            PatternScore(
                correlation=_number(correlation[k]),
                auroc=_number(auroc[k]),
                positions=int(n),
                matches=int(matches[k]),
            )
            for k in range(p.shape[0])
        ]


def _auroc(positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """AUROC of an ordinal predictor from its level counts among positives and negatives ([levels, keys]
    each): P(level of a positive > level of a negative) + ½ P(equal). NaN without both."""
    n_pos, n_neg = positive.sum(0), negative.sum(0)  # [keys]
    below = torch.cumsum(negative, 0) - negative  # negatives at a lower level, per level
    wins = (positive * (below + 0.5 * negative)).sum(0)  # [keys]
    return torch.where((n_pos > 0) & (n_neg > 0), wins / (n_pos * n_neg).clamp(min=1), torch.nan)


def _number(value: torch.Tensor) -> float | None:
    value = float(value)
    return None if math.isnan(value) else round(value, 4)
