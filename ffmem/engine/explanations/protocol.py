"""The field's scoring protocol for a memory's explanations (ffmem.engine.explanations), per polarity.

A *record* is one held-out sentence (text the run never mined), its positions from the first mined one
on (never position 0). For each polarity of a memory — the positive side (its pattern predicts m) and
the negative side (−m), each with its own pattern fitted on its own triggers' sentences — the protocol
(Bills et al. 2023, OpenAI's "simulate and score"; Choi et al. 2024) takes:

- its **top records**: the `top` held-out records where that side's sign · m peaks highest (found in a
  first pass, `TopRecords`), drawn from the records that are not random ones;
- the **random records**: `random` held-out records drawn once by a fixed shuffle (`random_records`),
  the same for every memory, so top and random are mixed 1:1 when `top == random`.

Over them (`ProtocolScores`, a second pass), with the pattern's match as the simulated activation:

- **pooled** — the Pearson correlation of the match with sign · m over every position of the top and
  random records together: the field's headline score;
- **random** — the same over the random records alone (the score ffmem gave before, on random text);
- **AUROC** — of the match for telling apart the pooled positions where the side *fires* (sign · m ≥
  half its largest in the mined corpus) from the rest (0.5: chance; ties count half);
- and each again as a **control**: the same memory's records and coefficients scored with another
  memory's pattern of the same layer and side (`control_keys`: a fixed shuffle, never the memory
  itself), so a layer's distribution of scores can be read against chance.

For a gated memory (m = act(x·g)·(x·u)) each of its four sign **quadrants** (pp, pn, np, nn: the
gate's sign, then the input's; ffmem.engine.mining.mined_layer.QUADRANTS) has a pattern of its own, fitted
on that quadrant's examples, and is scored the same way on the positions of its side's records (the side of
its m's sign: + in pp and nn, − in pn and np) that lie in it: the input x·u captured with m gives each
held-out position's quadrant (`quadrant_of`), as mining counts them.

Every score is computed from running sums over (position, memory) pairs of the records a memory
scores, never over a [positions, memories] matrix of matches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ffmem.engine.explanations.fitting import START, Pattern, pair_code
from ffmem.engine.explanations.scoring import MAX_LEVEL, LayerPatterns, auroc_of_levels
from ffmem.engine.mining.mined_layer import QUADRANT_SIGNS

POLARITIES = (1, -1)  # the positive side (predicts m), the negative side (predicts −m)
SEED = 0  # the fixed shuffles: the random records, the control memories
SCORE_ORDER = ("pooled", "pooled_control", "random", "random_control", "auroc", "auroc_control")  # as fields
STATS = ("n", "p", "pp", "m", "mm", "pm", "c", "cc", "cm", "hit")  # running sums; c: the control's match


def random_records(n_sentences: int, count: int, seed: int = SEED) -> np.ndarray:
    """[≤ count] the held-out records every memory is scored on at random, by a fixed shuffle, ascending."""
    chosen = np.random.default_rng(seed).permutation(n_sentences)[: max(count, 0)]
    return np.sort(chosen).astype(np.int64)


def quadrant_of(m: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each position's sign quadrant (0 pp, 1 pn, 2 np, 3 nn) from its m and input x·u (like shapes), as
    mining counts them: 2·(gate < 0) + (input < 0), the gate negative where m < 0 < u or u < 0 < m."""
    gate_negative = ((m < 0) & (u > 0)) | ((m > 0) & (u < 0))
    return gate_negative.long() * 2 + (u < 0).long()


def control_keys(n_keys: int, seed: int = SEED) -> np.ndarray:
    """[n_keys] each key's control: the key whose pattern scores it for chance, a fixed shuffle that is one
    cycle through every key (so never the key itself, with two keys or more)."""
    order = np.random.default_rng(seed).permutation(n_keys)
    control = np.empty(n_keys, dtype=np.int64)
    control[order] = np.roll(order, -1)
    return control


@dataclass
class ProtocolScore:
    """One side of a memory scored by the protocol (module docstring); None where undefined: the match or
    the coefficient never varies there, or the side never fires (AUROC)."""

    pooled: float | None
    pooled_control: float | None
    random: float | None
    random_control: float | None
    auroc: float | None
    auroc_control: float | None
    top_positions: int  # positions of its top records
    random_positions: int  # positions of the random records
    matches: int  # positions of both whose token or pair the pattern lists

    def to_dict(self) -> dict:
        return dict(vars(self))  # its fields (plain values: dataclasses.asdict's deep copy costs ~50 µs)


class TopRecords:
    """The first pass: per side, layer and key, the `count` held-out records (not random ones) where sign ·
    m peaks highest. `update(layer, coefficients, valid, sentences)` with one batch's [batch, pos, keys]
    coefficients, its [batch, pos] mined positions and [batch] record numbers; `records` after."""

    def __init__(self, n_layers: int, n_keys: int, count: int, random: np.ndarray, n_sentences: int):
        self.count = count
        self.random = torch.zeros(n_sentences, dtype=torch.bool)  # [sentences]
        self.random[torch.from_numpy(random)] = True
        self.peaks = torch.full((2, n_layers, count, n_keys), -math.inf)  # [sides, layers, count, keys]
        self.sentences = torch.full((2, n_layers, count, n_keys), -1, dtype=torch.long)

    def update(self, layer: int, coefficients: torch.Tensor, valid: torch.Tensor, sentences: torch.Tensor):
        if not self.count:
            return
        c = coefficients.float()
        mask = valid[..., None]  # [batch, pos, 1]
        highest = torch.where(mask, c, -math.inf).amax(1).cpu()  # [batch, keys]
        lowest = torch.where(mask, c, math.inf).amin(1).cpu()  # [batch, keys]
        sentences = sentences.cpu()
        skip = self.random[sentences]  # [batch]
        for side, peaks in enumerate((highest, -lowest)):
            peaks = peaks.masked_fill(skip[:, None], -math.inf)  # [batch, keys]
            both = torch.cat([self.peaks[side, layer], peaks])  # [count + batch, keys]
            ids = torch.cat([self.sentences[side, layer], sentences[:, None].expand_as(peaks)])
            kept = both.topk(min(self.count, len(both)), dim=0)  # [count, keys]
            self.peaks[side, layer, : len(kept.values)] = kept.values
            self.sentences[side, layer, : len(kept.values)] = ids.gather(0, kept.indices)

    def records(self) -> torch.Tensor:
        """[sides, layers, count, keys] each key's top records (−1: fewer held-out records peak there)."""
        return torch.where(self.peaks > -math.inf, self.sentences, -1)


class _SideTables:
    """One side and layer: its patterns as lookups by (position, key) pair."""

    def __init__(self, patterns: Sequence[Pattern], device):
        self.patterns = LayerPatterns(patterns, device)
        self.values = self.patterns.values.to(device)  # [levels, keys]

    def dense_levels(self, token: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
        """[Q, keys] uint8 every key's level at each position of tokens and pair codes [Q] each: its pair's
        where the pattern lists the pair, else its token's."""
        level = self.patterns.final.level(token)  # [Q, keys]
        if len(self.patterns.pairs) > 1:
            pairs = self.patterns.pairs.level(pair)  # [Q, keys]
            level = torch.where(pairs > 0, pairs, level)
        return level


class ProtocolScores:
    """The second pass (module docstring): running sums over the (position, key) pairs of each key's top
    records and the random records, per side (and quadrant) and layer. `update(layer, coefficients,
    input_ids, valid, sentences, inputs)` with one batch's [batch, pos, keys] coefficients, [batch, pos] ids
    and mined positions, [batch] record numbers and, where quadrants are scored, the inputs x·u [batch,
    pos, keys]; `scores(side, layer)` each key's ProtocolScore, `quadrant_scores(quadrant, layer)` each
    key's in that quadrant."""

    def __init__(
        self,
        patterns: Sequence[Sequence[Sequence[Pattern]]],
        fires_at: torch.Tensor,
        top: torch.Tensor,
        random: np.ndarray,
        n_sentences: int,
        device="cpu",
        quadrants: Sequence[Sequence[Sequence[Pattern]]] | None = None,
    ):
        """`patterns[side][layer][key]` (sides as POLARITIES); `fires_at` [sides, layers, keys]: the sign · m
        from which each side fires (NaN: never); `top` [sides, layers, count, keys] (TopRecords.records);
        `quadrants[quadrant][layer][key]` a gated model's quadrant patterns (None: not scored)."""
        n_sides, n_layers, n_keys = fires_at.shape
        self.device = device
        self.n_sides = n_sides
        groups = list(patterns) + list(quadrants or [])  # the sides, then the quadrants
        self.tables = [[_SideTables(layer, device) for layer in group] for group in groups]
        self.fires_at = fires_at.to(device)
        self.control = torch.from_numpy(control_keys(n_keys)).to(device)  # [keys]
        self.random = torch.zeros(n_sentences, dtype=torch.bool)  # [sentences]
        self.random[torch.from_numpy(random)] = True
        self.random = self.random.to(device)
        self.top = torch.zeros(n_sides, n_layers, n_sentences + 1, n_keys, dtype=torch.bool)  # row −1: none
        count = top.shape[2]
        keys = torch.arange(n_keys).expand(count, n_keys)  # [count, keys]
        for side, layer in np.ndindex(n_sides, n_layers):
            self.top[side, layer][top[side, layer], keys] = True
        self.top = self.top[:, :, :-1].to(device)  # [sides, layers, sentences, keys]
        n_groups = len(groups)
        self.sums = torch.zeros(
            n_groups, n_layers, 2, len(STATS), n_keys, dtype=torch.float64
        )  # [.., random?]
        # positions by [match or control, fires?, level]: the AUROCs (counts: int32, half float64's memory —
        # 0.36 GB at SmolLM2's 30 × 1,536 memories with their 6 groups)
        self.levels = torch.zeros(n_groups, n_layers, 2, 2, MAX_LEVEL + 1, n_keys, dtype=torch.int32)

    def update(
        self,
        layer: int,
        coefficients: torch.Tensor,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        sentences: torch.Tensor,
        inputs: torch.Tensor | None = None,
    ):
        rows, positions = valid.nonzero(as_tuple=True)  # [Q] each
        token = input_ids[rows, positions]  # [Q]
        previous = torch.where(positions > 0, input_ids[rows, (positions - 1).clamp(min=0)], START)  # [Q]
        record = sentences.to(self.device)[rows]  # [Q]
        is_random = self.random[record]  # [Q]
        m_all = coefficients[rows, positions]  # [Q, keys]
        u_all = inputs[rows, positions] if inputs is not None else None  # [Q, keys]
        codes = (token, pair_code(previous, token))  # [Q] each
        for side, sign in enumerate(POLARITIES):
            chosen = self.top[side, layer][record] | is_random[:, None]  # [Q, keys]
            q, key = chosen.nonzero(as_tuple=True)  # [P] each
            if not len(q):
                continue
            m = (sign * m_all[q, key]).double()  # [P]
            fires = m >= self.fires_at[side, layer][key]  # [P] (NaN thresholds: never)
            self._add(side, layer, codes, q, key, m, fires, is_random[q])
            if u_all is None or len(self.tables) == self.n_sides:
                continue
            quadrant = quadrant_of(m_all[q, key], u_all[q, key])  # [P]
            for number, quadrant_sign in enumerate(QUADRANT_SIGNS):
                inside = (quadrant == number).nonzero(as_tuple=True)[0] if quadrant_sign == sign else None
                if inside is not None and len(inside):
                    group = self.n_sides + number
                    found = (q[inside], key[inside], m[inside], fires[inside], is_random[q[inside]])
                    self._add(group, layer, codes, *found)

    def _add(self, group, layer, codes, q, key, m, fires, is_random):
        """Add (position, key) pairs to a group's running sums: `q` [P] their positions (rows of `codes`,
        the positions' token and pair codes [Q] each), `key` [P], `m` [P] sign · m, `fires` [P] bool,
        `is_random` [P] whether their record is a random one."""
        tables = self.tables[group][layer]
        n_keys = self.sums.shape[-1]
        control = self.control[key]  # [P]
        every = tables.dense_levels(*codes)  # [Q, keys]
        level, control_level = every[q, key], every[q, control]  # [P] each
        p = tables.values[level.long(), key]  # [P]
        c = tables.values[control_level.long(), control]  # [P]
        bins = is_random.long() * n_keys + key  # [P]
        for i, weight in enumerate((None, p, p * p, m, m * m, p * m, c, c * c, c * m, (level > 0).double())):
            found = torch.bincount(bins, weights=weight, minlength=2 * n_keys).view(2, n_keys)
            self.sums[group, layer, :, i] += found.double().cpu()
        fires = fires.long()
        for which, lev in enumerate((level, control_level)):
            at = (fires * (MAX_LEVEL + 1) + lev.long()) * n_keys + key  # [P]
            found = torch.bincount(at, minlength=2 * (MAX_LEVEL + 1) * n_keys)
            self.levels[group, layer, which] += found.view(2, MAX_LEVEL + 1, n_keys).int().cpu()

    def scores(self, side: int, layer: int) -> list[ProtocolScore]:
        return self._scores(side, layer)

    def quadrant_scores(self, quadrant: int, layer: int) -> list[ProtocolScore]:
        """Each key's scores in one quadrant (0 pp, 1 pn, 2 np, 3 nn): over the positions of its side's top
        records and of the random records that lie in it."""
        return self._scores(self.n_sides + quadrant, layer)

    def _scores(self, group: int, layer: int) -> list[ProtocolScore]:
        sums = self.sums[group, layer]  # [random?, stats, keys]
        pooled, random = sums.sum(0), sums[1]  # [stats, keys] each
        values = self.tables[group][layer].values.cpu()  # [levels, keys]
        control = self.control.cpu()
        levels = self.levels[group, layer].double()  # [match or control, fires?, levels, keys]
        auroc = auroc_of_levels(levels[0, 1], levels[0, 0], values)  # [keys]
        auroc_control = auroc_of_levels(levels[1, 1], levels[1, 0], values[:, control])  # [keys]
        has_control = len(control) > 1
        found = {
            "pooled": _pearson(pooled, "p"),
            "pooled_control": _pearson(pooled, "c"),
            "random": _pearson(random, "p"),
            "random_control": _pearson(random, "c"),
        }
        found |= {"auroc": auroc, "auroc_control": auroc_control}
        numbers = {name: _rounded(value.tolist()) for name, value in found.items()}  # [keys] each
        if not has_control:
            for name in ("pooled_control", "random_control", "auroc_control"):
                numbers[name] = [None] * values.shape[1]
        counts = (sums[0, 0], sums[1, 0], pooled[-1])  # [keys] each: top and random positions, matches
        columns = [numbers[name] for name in SCORE_ORDER] + [list(map(int, c.tolist())) for c in counts]
        return [ProtocolScore(*fields) for fields in zip(*columns, strict=True)]


def _pearson(sums: torch.Tensor, of: str) -> torch.Tensor:
    """[keys] the correlation of the match `of` ("p": the pattern's, "c": the control's) with sign · m from
    running sums [STATS, keys]; NaN where either never varies."""
    s = dict(zip(STATS, sums, strict=True))  # [keys] each
    n = s["n"].clamp(min=1)
    x, xx, xm = s[of] / n, s[of + of] / n, s[of + "m"] / n
    m, mm = s["m"] / n, s["mm"] / n
    var_x, var_m = (xx - x * x).clamp(min=0), (mm - m * m).clamp(min=0)
    defined = (var_x > 1e-12) & (var_m > 1e-12) & (s["n"] > 1)
    return torch.where(defined, (xm - x * m) / (var_x * var_m).sqrt().clamp(min=1e-30), torch.nan)


def _rounded(values: list[float]) -> list[float | None]:
    """Each value to 4 decimals, None where NaN (the only value unequal to itself)."""
    return [None if value != value else round(value, 4) for value in values]
