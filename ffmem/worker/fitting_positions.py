"""The mined positions each pattern of a layer is fitted on (ffmem.worker.explanations), the layer's keys at
once: per key, each side's (POLARITIES) — every mined token of the shaded sentences of its first triggers
of that sign and of its band samples, each sentence once — then, for a gated key, each quadrant's that has
examples (QUADRANTS' numbers) — the position of each of its examples, then every mined token of its band
samples' sentences (each once). Flat arrays, one pattern after another, as
ffmem.engine.explanations.fitting.fit_patterns takes them (`layer_positions`). A run stored before the
shading has its patterns fitted on its top triggers alone, gathered key by key (`key_positions`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ffmem.engine.explanations.fitting import START
from ffmem.engine.explanations.protocol import POLARITIES
from ffmem.engine.mining.mined_layer import QUADRANT_SIGNS, QUADRANTS
from ffmem.store.key_examples import NOT_MINED, StoredExamples, shading_codes

if TYPE_CHECKING:
    from ffmem.store.memory_lists import Lists
    from ffmem.worker.explanations import _RunInputs

GROUPS = len(POLARITIES) + len(QUADRANTS)  # a key's patterns: its sides, then its quadrants


@dataclass
class LayerPositions:
    """A layer's patterns' positions, pattern after pattern (per key: its sides, then its quadrants that
    have examples)."""

    tokens: np.ndarray  # [positions] int64
    previous: np.ndarray  # [positions] int64: START at a sentence's first
    m: np.ndarray  # [positions] float64: the coefficient there
    lengths: np.ndarray  # [patterns] int64
    signs: np.ndarray  # [patterns] int64
    quadrants: list[list[int]]  # [keys] the quadrants each key has a pattern of, ascending


def layer_positions(
    shaded: Mapping[int, StoredExamples], triggers: Mapping[int, Lists], run: _RunInputs, n_keys: int
) -> LayerPositions:
    """Every key's patterns' positions (module docstring) from its stored examples (`shaded`: key → them,
    every key of the layer) and the layer's triggers of each sign."""
    stored = [shaded[key] for key in range(n_keys)]
    counts = np.array([(s.positive, s.negative, len(s.samples)) for s in stored], np.int64).reshape(-1, 3)
    # the shaded sentences ("slots"), key after key: its positive triggers', negative's, samples'
    parts = [_first_triggers(triggers[sign], counts[:, kind], n_keys) for kind, sign in enumerate(POLARITIES)]
    samples = np.array([e.sentence_index for s in stored for e in s.samples], np.int64)  # [samples]
    parts.append((np.repeat(np.arange(n_keys), counts[:, 2]), samples))
    slot_key = np.concatenate([key for key, _ in parts])  # [slots]
    slot_kind = np.repeat(np.arange(3), [len(key) for key, _ in parts])  # [slots]
    order = np.lexsort((slot_kind, slot_key))  # stable: each kind's sentences in their order
    slot_key, slot_kind = slot_key[order], slot_kind[order]  # [slots] each
    slot_sentence = np.concatenate([sentence for _, sentence in parts])[order]  # [slots]
    begins = run.starts[slot_sentence]  # [slots] where each sentence begins in the corpus's tokens
    lengths = run.starts[slot_sentence + 1] - begins  # [slots]
    values = _shading(stored, counts.sum(axis=1), lengths, np.bincount(slot_key, lengths, n_keys))
    offsets = np.cumsum(lengths) - lengths  # [slots] where each begins in `values`
    token_slot = np.repeat(np.arange(len(lengths)), lengths)  # [tokens]
    corpus = np.repeat(begins - offsets, lengths) + np.arange(len(values))  # [tokens] corpus index
    mined = ~np.isnan(values)  # [tokens]
    # each group's tokens: (pattern group, its order inside the pattern, token), one array each
    found = []
    for side in range(len(POLARITIES)):
        kept = _first_each(slot_key, slot_sentence, (slot_kind == side) | (slot_kind == 2))  # [slots]
        at = np.flatnonzero(kept[token_slot] & mined)  # [its tokens]
        found.append((slot_key[token_slot[at]] * GROUPS + side, at))
    quadrants = [[] for _ in range(n_keys)]
    examples = [(k, e) for k, s in enumerate(stored) for e in (s.quadrants or [])]
    if examples:
        behind = np.flatnonzero(_first_each(slot_key, slot_sentence, slot_kind == 2)[token_slot] & mined)
        found += _quadrant_positions(examples, slot_key[token_slot[behind]], behind, quadrants, run)
    group, where = _in_patterns(found, n_keys * GROUPS)  # [positions] each
    source = values  # [tokens (+ examples)] the coefficient at each
    if examples:  # an example's `where` (−1 − its index) points past the tokens
        corpus = np.concatenate(
            [corpus, np.array([run.starts[e.sentence_index] + e.position for _, e in examples], np.int64)]
        )
        source = np.concatenate([values, np.array([e.coefficient for _, e in examples])])  # float64
        where = np.where(where >= 0, where, len(values) - 1 - where)
    at = corpus[where]  # [positions] corpus index
    tokens, previous, m = run.tokens[at], run.previous[at], source[where].astype(np.float64)
    present = np.zeros((n_keys, GROUPS), bool)  # [keys, groups]: the patterns fitted
    present[:, : len(POLARITIES)] = True
    for key, numbers in enumerate(quadrants):
        present[key, [len(POLARITIES) + n for n in numbers]] = True
    sizes = np.bincount(group, minlength=n_keys * GROUPS)[present.reshape(-1)]  # [patterns]
    signs = np.array([*POLARITIES, *QUADRANT_SIGNS], np.int64)[np.nonzero(present)[1]]  # [patterns]
    return LayerPositions(tokens, previous, m, sizes, signs, quadrants)


def _in_patterns(parts: list[tuple[np.ndarray, np.ndarray]], n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Parts (group [n] ascending, where [n]) laid out group after group, each group's entries part after
    part in their order: (group, where) [positions] each, as a stable sort by group would give them."""
    sizes = [np.bincount(group, minlength=n_groups) for group, _ in parts]  # [parts][groups]
    total = np.sum(sizes, axis=0) if parts else np.zeros(n_groups, np.int64)  # [groups]
    placed = np.cumsum(total) - total  # [groups] where each group's next entry goes
    group, where = np.empty(int(total.sum()), np.int64), np.empty(int(total.sum()), np.int64)
    for (part, at), size in zip(parts, sizes, strict=True):
        index = np.arange(len(part))  # [n]
        begins = np.r_[True, part[1:] != part[:-1]] if len(part) else np.zeros(0, bool)  # [n] a group's first
        into = placed[part] + index - np.maximum.accumulate(np.where(begins, index, 0))  # [n]
        group[into], where[into] = part, at
        placed = placed + size
    return group, where


def _first_triggers(found: Lists, counts: np.ndarray, n_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """(key, sentence) [chosen] of each key's first `counts[key]` triggers (in their stored order)."""
    key = found.key.astype(np.int64)  # [entries]
    order = np.argsort(key, kind="stable")  # [entries]
    key = key[order]
    rank = np.arange(len(key)) - np.searchsorted(key, key)  # [entries] within its key
    chosen = order[rank < counts[key]]
    if (np.bincount(key[rank < counts[key]], minlength=n_keys) != counts).any():
        raise ValueError("the stored shading does not match these sentences")
    return key[rank < counts[key]], found.entries["sentence_index"][chosen].astype(np.int64)


def _shading(stored: list[StoredExamples], sentences: np.ndarray, lengths: np.ndarray, tokens: np.ndarray):
    """[tokens] float32 every key's stored shading one after another (NaN where not mined), as
    StoredExamples.shading decodes each: `sentences` [keys] and `tokens` [keys] each one's counts,
    `lengths` [slots] its sentences' lengths."""
    parts = [shading_codes(s.data, n) for s, n in zip(stored, sentences.tolist(), strict=True)]
    if [len(codes) for _, codes in parts] != tokens.tolist():
        raise ValueError("the stored shading does not match these sentences")
    steps = np.concatenate([steps for steps, _ in parts] or [np.zeros(0, np.float32)])  # [slots]
    codes = np.concatenate([codes for _, codes in parts] or [np.zeros(0, np.int8)])  # [tokens]
    values = codes.astype(np.float32) * np.repeat(steps, lengths)  # [tokens]
    values[codes == NOT_MINED] = np.nan
    return values


def _first_each(key: np.ndarray, sentence: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """[slots] bool: the chosen slots whose sentence is the key's first chosen one of that sentence."""
    at = np.flatnonzero(chosen)  # [c]
    _, first = np.unique(key[at] * (int(sentence.max(initial=0)) + 1) + sentence[at], return_index=True)
    kept = np.zeros(len(key), bool)
    kept[at[first]] = True
    return kept


def _quadrant_positions(examples: list, behind_key: np.ndarray, behind: np.ndarray, quadrants, run):
    """Each quadrant pattern's (group, where) parts: its examples (where −1 − their index among
    `examples`, (key, QuadrantExample) pairs), then its key's band samples' tokens (`behind` [b] token
    indices, `behind_key` [b] theirs), appending to `quadrants` [keys] the numbers that have examples."""
    key = np.array([k for k, _ in examples], np.int64)  # [examples]
    number = np.array([e.quadrant for _, e in examples], np.int64)  # [examples]
    group = key * GROUPS + len(POLARITIES) + number  # [examples]
    # every (key, quadrant) with examples gets its key's band samples' tokens after them
    patterns = np.unique(group)  # [quadrant patterns]
    for g in patterns.tolist():
        quadrants[g // GROUPS].append(g % GROUPS - len(POLARITIES))
    start = np.searchsorted(behind_key, patterns // GROUPS)  # [quadrant patterns]
    size = np.searchsorted(behind_key, patterns // GROUPS, side="right") - start  # [quadrant patterns]
    offsets = np.cumsum(size) - size  # [quadrant patterns]
    picked = np.repeat(start - offsets, size) + np.arange(size.sum())  # [their tokens]
    order = np.argsort(group, kind="stable")  # [examples] by pattern, each one's in their order
    return [(group[order], -1 - order), (np.repeat(patterns, size), behind[picked])]


def key_positions(shaded: dict, by_key: dict, run: _RunInputs, n_keys: int) -> tuple[tuple, list[list[int]]]:
    """fit_patterns' positions, lengths and signs of a layer's patterns gathered key by key (a key's
    stored examples, or its triggers where it has none), and the quadrants each key has a pattern of."""
    positions, signs, in_quadrants = [], [], []  # per key its sides, then its quadrants
    for key in range(n_keys):
        found = {s: by_key[s][key] for s in POLARITIES}
        sides, quadrants = _fitting_positions(shaded.get(key), found, run)
        positions += [sides[sign] for sign in POLARITIES] + list(quadrants.values())
        signs += list(POLARITIES) + [QUADRANT_SIGNS[number] for number in quadrants]
        in_quadrants.append(list(quadrants))
    arrays = tuple(np.concatenate([p[part] for p in positions]) for part in range(3))
    return (*arrays, [len(p[2]) for p in positions], signs), in_quadrants


def by_key(found, n_keys: int, first: int | None = None) -> list[list[tuple[int, int, float]]]:
    """A layer's triggers of one sign as (sentence, position, coefficient) per key, the strongest first
    (each key's `first` alone, where given)."""
    chosen = slice(None)
    if first is not None:
        key = found.key.astype(np.int64)  # [entries]
        order = np.argsort(key, kind="stable")  # [entries]
        rank = np.empty(len(key), np.int64)  # [entries] within its key, in their order
        rank[order] = np.arange(len(key)) - np.searchsorted(key[order], key[order])
        chosen = rank < first
    triggers: list[list[tuple[int, int, float]]] = [[] for _ in range(n_keys)]
    entries = found.entries[chosen]
    for key, sentence, position, coefficient in zip(
        found.key[chosen].tolist(),
        entries["sentence_index"].tolist(),
        entries["position"].tolist(),
        entries["coefficient"].tolist(),
        strict=True,
    ):
        triggers[key].append((sentence, position, coefficient))
    return triggers


def _fitting_positions(
    stored: StoredExamples | None, triggers: dict[int, list], run: _RunInputs
) -> tuple[dict[int, tuple[np.ndarray, ...]], dict[int, tuple[np.ndarray, ...]]]:
    """Per side (POLARITIES), (tokens, previous tokens, coefficients) of the mined positions its pattern is
    fitted on (its own records): every mined token of the shaded sentences of its first triggers of that
    sign and of its band samples (each sentence once), or — for a run stored before the shading — its top
    triggers of that sign alone. The stored shading is decoded once for both. Then, for a gated memory,
    the same per quadrant that has examples (QUADRANTS' numbers): the position of each of its examples
    (ffmem.store.key_examples.QuadrantExample), then every mined token of the band samples' sentences."""
    sentences = run.sentences
    if stored is None:
        return {side: _trigger_positions(triggers[side], run) for side in POLARITIES}, {}
    positive = [s for s, _, _ in triggers[1][: stored.positive]]
    negative = [s for s, _, _ in triggers[-1][: stored.negative]]
    samples = [sample.sentence_index for sample in stored.samples]
    arrays = stored.shading([len(sentences[s]) for s in positive + negative + samples])
    shown = len(positive) + len(negative)
    backdrop = list(zip(samples, arrays[shown:], strict=True))
    own = {
        1: list(zip(positive, arrays[: len(positive)], strict=True)) + backdrop,
        -1: list(zip(negative, arrays[len(positive) : shown], strict=True)) + backdrop,
    }
    quadrants = {}
    if stored.quadrants:
        behind = _positions(backdrop, run)
        for number in range(len(QUADRANTS)):
            chosen = [
                (e.sentence_index, e.position, e.coefficient)
                for e in stored.quadrants
                if e.quadrant == number
            ]
            if chosen:
                examples = _trigger_positions(chosen, run)
                quadrants[number] = tuple(
                    np.concatenate(parts) for parts in zip(examples, behind, strict=True)
                )
    return {side: _positions(chosen, run) for side, chosen in own.items()}, quadrants


def _trigger_positions(chosen: list, run: _RunInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, previous tokens, coefficients) of (sentence, position, coefficient) triples."""
    sentences = run.sentences
    tokens = np.array([sentences[s][p] for s, p, _ in chosen], dtype=np.int64)
    previous = np.array([sentences[s][p - 1] if p else START for s, p, _ in chosen], dtype=np.int64)
    return tokens, previous, np.array([c for _, _, c in chosen], dtype=np.float64)


def _positions(chosen: list, run: _RunInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, previous tokens, coefficients) of the mined positions of (sentence, shading) pairs, each
    sentence once."""
    sentences, arrays, seen = [], [], set()
    for sentence, values in chosen:
        if sentence not in seen:
            seen.add(sentence)
            sentences.append(sentence)
            arrays.append(values)
    if not sentences:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    values = np.concatenate(arrays)  # [positions] the sentences' shading, one after another
    starts = run.starts[sentences]  # [sentences] where each begins in the corpus's tokens
    lengths = run.starts[np.asarray(sentences) + 1] - starts  # [sentences]
    index = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(len(values))  # [positions]
    mined = ~np.isnan(values)  # [positions]
    index = index[mined]
    return run.tokens[index], run.previous[index], values[mined].astype(np.float64)
