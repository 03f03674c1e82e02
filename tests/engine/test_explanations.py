"""Explanations: the token table fitted on a memory's mined positions (against a hand computation), its
description, its matching against every key at once (against a loop over positions), its scores (against
numpy's correlation and a pairwise AUROC), the memory's sign, and determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ffmem.engine.explanations.description import describe
from ffmem.engine.explanations.fitting import (
    START,
    CorpusCounts,
    Pattern,
    _significant,
    dominant_sign,
    fit_pattern,
)
from ffmem.engine.explanations.protocol import (
    POLARITIES,
    ProtocolScores,
    TopRecords,
    control_keys,
    random_records,
)
from ffmem.engine.explanations.scoring import LayerPatterns, PatternScores
from ffmem.engine.mining.mined_layer import QUADRANT_SIGNS

TEXTS = ["<pad>", " the", " city", " of", " Paris", " capital", " France", ".", " is", " river", "\n", " a"]
T = {text.strip() or text: i for i, text in enumerate(TEXTS)}
CODE = 2**32  # a pair's code: (previous + 1) · 2³² + token


def hand_fit(tokens, previous, m, sign, corpus, prior=3.0, least=0.01):
    """The pattern by hand: weights are shrunk means of sign · m less the mean, tokens and pairs kept by
    corpus count × (weight − the weight it replaces)², at least 1% of the first, largest first."""
    m = [sign * x for x in m]
    mean = sum(m) / len(m)

    def shrunk(groups, towards):
        return {g: (sum(xs) + prior * towards(g)) / (len(xs) + prior) - mean for g, xs in groups.items()}

    by_token, by_pair = {}, {}
    for t, b, x in zip(tokens, previous, m, strict=True):
        by_token.setdefault(t, []).append(x)
        by_pair.setdefault((b, t), []).append(x)
    flat = [t for sentence in corpus for t in sentence]
    pairs_seen = [(b, t) for s in corpus for b, t in zip([START, *s[:-1]], s, strict=True)]

    def keep(fitted, count, base, most):
        importance = {g: count(g) * (w - base(g)) ** 2 for g, w in fitted.items()}
        order = sorted(importance, key=lambda g: (-importance[g], g))[:most]
        return [g for g in order if importance[g] > 0 and importance[g] >= least * importance[order[0]]]

    token_weight = shrunk(by_token, lambda t: mean)
    final = keep(token_weight, flat.count, lambda t: 0.0, 64)
    weights = {t: float(f"{token_weight[t]:.3g}") for t in final}
    pair_weight = shrunk(by_pair, lambda g: mean + weights.get(g[1], 0.0))
    pairs = keep(pair_weight, pairs_seen.count, lambda g: weights.get(g[1], 0.0), 16)
    return final, [weights[t] for t in final], pairs, [float(f"{pair_weight[g]:.3g}") for g in pairs]


def test_the_fitted_pattern_equals_a_hand_computation():
    corpus = [[1, 4, 2, 4], [3, 4, 4, 9], [1, 2, 9, 4, 4, 7], [9, 9, 9, 9]]
    counts = CorpusCounts.of(corpus, 12)
    assert counts.tokens[9] == 6 and counts.tokens[4] == 6
    assert counts.of_pairs(np.array([(4 + 1) * CODE + 4, (START + 1) * CODE + 1, 7 * CODE + 7])).tolist() == [
        2,
        2,
        0,
    ]
    # the shaded positions: token 4 high, after 3 higher still; token 9 low; token 2 at the mean
    tokens = [4, 4, 4, 9, 9, 2, 2, 4, 11]
    previous = [1, 3, 2, 4, 9, START, 1, 4, 4]
    m = [3.0, 5.0, 2.5, -1.0, -1.5, 0.2, 0.1, 2.0, 0.0]
    for sign in (1, -1):
        got = fit_pattern(np.array(tokens), np.array(previous), np.array(m), sign, counts)
        final, weights, pairs, pair_weights = hand_fit(tokens, previous, m, sign, corpus)
        assert got.sign == sign
        assert got.final == final and got.weights == weights
        assert [tuple(p) for p in got.pairs] == pairs and got.pair_weights == pair_weights
    positive = fit_pattern(np.array(tokens), np.array(previous), np.array(m), 1, counts)
    assert positive.final[:2] == [4, 9] and positive.weights[0] > 0 > positive.weights[1]
    assert (3, 4) in [tuple(p) for p in positive.pairs]  # " Paris" after " of" is higher than " Paris" alone
    assert 11 not in positive.final and [4, 11] not in positive.pairs  # never in the corpus: no importance
    negative = fit_pattern(np.array(tokens), np.array(previous), np.array(m), -1, counts)
    assert negative.weights == [-w for w in positive.weights]  # −m: the same tokens, weights negated
    assert fit_pattern(np.zeros(0, int), np.zeros(0, int), np.zeros(0), 1, counts) == Pattern()


def test_a_weight_keeps_three_significant_digits_as_its_decimal_text_does():
    """_significant rounds as float(f"{w:.3g}") does: halves of the exact decimal to even, powers of ten
    at the edge of log10, signed zeros, values too small or large for an exact power of ten, NaN."""
    edges = [0.1235, 1.005, 2.675, 999.5, 999.4999, 99.95, 0.001, 1e3, 124.5, -124.5, 0.1255, 1e-30, 1e30]
    edges += [0.0, -0.0, 5e-324, 1.7e308, math.inf, -math.inf, 1.0, -2.5e-7]
    rng = np.random.default_rng(0)
    values = np.concatenate([edges, rng.standard_normal(20_000) * 10.0 ** rng.integers(-9, 9, 20_000)])
    values = np.concatenate([values, (np.arange(2_000) + 0.5) / 10.0 ** rng.integers(0, 8, 2_000)])
    got = _significant(values)
    expected = np.array([float(f"{value:.3g}") for value in values.tolist()])
    assert np.array_equal(got, expected) and np.array_equal(np.signbit(got), np.signbit(expected))
    assert np.isnan(_significant(np.array([math.nan])))[0]


def test_the_description_names_the_pattern():
    pattern = Pattern(
        sign=1,
        final=[T["Paris"], T["the"], T["France"]],
        weights=[2.5, -0.25, 0.75],
        pairs=[[T["of"], T["Paris"]], [START, T["Paris"]]],
        pair_weights=[3.25, -1.0],
    )
    text = describe(pattern, [T["capital"], T["river"]], 0.8, TEXTS).text
    # the sentence a person would write: the tokens that raise m (a token with the pair that outweighs it
    # alone), the one that holds it back, what the value then writes; the weights stay in the table
    assert text == (
        "Fires on “ Paris” after “ of” and “ France”, not on “ the”; then writes “ capital” and “ river”. "
        "Shallow: it hinges on the last token."
    )
    negative = Pattern(sign=-1, final=[T["Paris"]], weights=[2.5])
    assert describe(negative, [T["river"]], 0.1, TEXTS).text == (
        "Goes negative on “ Paris”; then writes “ river”. Semantic: it reads more than the last token."
    )
    many = Pattern(final=list(range(1, 10)), weights=[float(w) for w in range(9, 0, -1)])
    assert describe(many, [], None, TEXTS).text == "Fires on “ the”, “ city”, “ of” and “ Paris”."
    lone_pair = Pattern(final=[T["is"]], weights=[1.0], pairs=[[START, T["a"]]], pair_weights=[2.0])
    assert describe(lone_pair, [], None, TEXTS).text == "Fires on “ is” and “ a” after the start."
    assert describe(Pattern(), [T["is"]], None, TEXTS).text == (
        "No token sets it apart in its records; it writes “ is”."
    )


def test_the_sign_of_a_memory_and_of_its_score():
    """A memory whose strongest coefficients are negative is explained on −m: fitted there, its pattern
    correlates positively with −m on held-out text and its AUROC ranks where −m fires."""
    assert dominant_sign(1.0, -3.0) == -1 and dominant_sign(3.0, -1.0) == 1
    assert (
        dominant_sign(None, None) == 1 and dominant_sign(None, -0.5) == -1 and dominant_sign(2.0, -2.0) == 1
    )
    counts = CorpusCounts.of([[1, 2, 3, 4]] * 4, 12)
    fitted = fit_pattern(
        np.array([4, 4, 1, 2, 3]), np.array([3, 3, 0, 1, 2]), np.array([-4.0, -3.0, 0, 0.1, 0]), -1, counts
    )
    assert fitted.sign == -1 and fitted.final[0] == 4 and fitted.weights[0] > 0
    sentences = torch.tensor([[1, 2, 3, 4, 2, 4], [4, 1, 4, 3, 2, 1]])
    m = torch.where(sentences == 4, -3.0, 0.2)[..., None].repeat(1, 1, 2)  # [batch, pos, keys]
    valid = torch.ones_like(sentences, dtype=torch.bool)
    scores = PatternScores(
        [[fitted, Pattern(sign=1, final=fitted.final, weights=fitted.weights)]], torch.tensor([[1.5, 1.5]])
    )
    scores.update(0, m, sentences, valid)
    on_minus, on_plus = scores.scores(0)
    assert on_minus.correlation > 0.9 and on_minus.auroc == 1.0
    assert on_plus.correlation < -0.9 and on_plus.auroc is None  # +m never reaches 1.5: never fires


def reference_match(patterns: list[Pattern], sentences: list[list[int]], valid: torch.Tensor) -> np.ndarray:
    """Each pattern's match at each valid position, by a loop: its pair's weight, else its token's, else 0."""
    found = []
    for row, ids in enumerate(sentences):
        for position, token in enumerate(ids):
            if valid[row, position]:
                before = ids[position - 1] if position else START
                found.append([])
                for p in patterns:
                    pairs = {tuple(pair): w for pair, w in zip(p.pairs, p.pair_weights, strict=True)}
                    tokens = dict(zip(p.final, p.weights, strict=True))
                    found[-1].append(pairs.get((before, token), tokens.get(token, 0.0)))
    return np.array(found, dtype=np.float64)


PATTERNS = [
    Pattern(final=[1], weights=[1.0]),
    Pattern(sign=-1, final=[2, 3], weights=[0.5, -0.25]),
    Pattern(pairs=[[1, 2]], pair_weights=[2.0]),
    Pattern(final=[2], weights=[1.0], pairs=[[1, 2], [START, 2]], pair_weights=[-1.0, 3.0]),
    Pattern(),  # no tokens: matches nothing
    Pattern(final=[999], weights=[1.0], pairs=[[998, 999]], pair_weights=[2.0]),  # never occurs
    Pattern(final=[1000, 0], weights=[0.5, 0.5]),  # a tie between two tokens
    Pattern(sign=-1, final=[4, 5, 1], weights=[1.0, 1.0, -2.0], pairs=[[4, 4]], pair_weights=[1.0]),
    Pattern(final=[3], weights=[2.0]),
]


def test_match_levels_give_each_positions_weight():
    sentences = [[3, 1, 2, 4, 4, 2], [2, 1, 2, 3, 0, 0]]
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    patterns = LayerPatterns(PATTERNS)
    level = patterns.match(torch.tensor(sentences), valid)  # [Q, keys]
    got = patterns.values.gather(0, level.long()).numpy()  # [Q, keys]
    assert got.tolist() == reference_match(PATTERNS, sentences, valid).tolist()


def test_the_lookup_holds_each_patterns_entries_alone():
    """No [codes, keys] table: one entry for each token and pair a pattern weighs (a layer of 8,192 keys
    over a whole corpus would hold ~0.6 GB densely); patterns that weigh nothing match nothing."""
    patterns = LayerPatterns(PATTERNS)
    assert len(patterns.final.keys) == sum(len(p.final) for p in PATTERNS)
    assert len(patterns.pairs.keys) == sum(len(p.pairs) for p in PATTERNS)
    empty = LayerPatterns([Pattern(), Pattern()])
    level = empty.match(torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.bool))  # [positions, keys]
    assert level.tolist() == [[0, 0], [0, 0]]


def test_scores_equal_a_reference_computation():
    """Several batches of random tokens and coefficients against numpy on every position at once: pairs at
    a sentence's start, tokens past every pattern's, keys that never match or never fire, both signs."""
    rng = np.random.default_rng(0)
    frequencies = [0.05, 0.2, 0.2, 0.15, 0.15, 0.15, 0.05, 0.05]
    fires_at = torch.tensor([[1.0, 1.5, 0.5, float("nan"), 1.0, 2.0, -100.0, 0.5, 100.0]])
    scores = PatternScores([PATTERNS], fires_at)
    all_match, all_m = [], []
    for rows, width in ((4, 9), (3, 1), (6, 15), (5, 12)):
        sentences = rng.choice([*range(7), 1000], size=(rows, width), p=frequencies).tolist()
        valid = torch.from_numpy(rng.random((rows, width)) > 0.2)
        match = reference_match(PATTERNS, sentences, valid)
        m = rng.normal(size=(rows, width, len(PATTERNS))).astype(np.float32)
        signs = np.array([p.sign for p in PATTERNS], dtype=np.float32)
        m[valid.numpy()] += 2.0 * signs * match.astype(np.float32).reshape(-1, len(PATTERNS))
        scores.update(0, torch.from_numpy(m), torch.tensor(sentences), valid)
        all_match.append(match)
        all_m.append(m[valid.numpy()] * signs)  # sign · m
    match, m = np.concatenate(all_match), np.concatenate(all_m).astype(np.float64)
    found = scores.scores(0)
    for key, score in enumerate(found):
        p = match[:, key]
        correlation = np.corrcoef(p, m[:, key])[0, 1] if p.std() > 0 else None
        fires = m[:, key] >= fires_at[0, key].item()
        pos, neg = p[fires], p[~fires]
        pairs = (pos[:, None] > neg[None]) + 0.5 * (pos[:, None] == neg[None])  # [positives, negatives]
        auroc = pairs.mean() if pairs.size else None
        assert score.positions == len(m), key
        assert score.correlation == (None if correlation is None else round(correlation, 4)), key
        assert score.auroc == (None if auroc is None else round(auroc, 4)), key
    assert found[0].correlation > 0.5 and found[1].correlation > 0.3  # the planted relations, both signs
    assert found[4].correlation is None and found[4].matches == 0  # no tokens: nothing to correlate
    assert found[5].correlation is None and found[5].matches == 0 and found[5].auroc is not None
    assert found[3].auroc is None and found[8].auroc is None  # never fires
    assert found[6].auroc is None  # always fires


def test_matches_count_the_positions_a_pattern_lists():
    sentences = [[3, 1, 2, 4, 4, 2], [2, 1, 2, 3, 0, 0]]
    valid = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    scores = PatternScores([PATTERNS], torch.zeros(1, len(PATTERNS)))
    scores.update(0, torch.ones(2, 6, len(PATTERNS)), torch.tensor(sentences), valid)
    listed = []
    for p in PATTERNS:
        pairs, count = {tuple(pair) for pair in p.pairs}, 0
        for row, ids in enumerate(sentences):
            for position, token in enumerate(ids):
                before = ids[position - 1] if position else START
                count += bool(valid[row, position]) and ((before, token) in pairs or token in p.final)
        listed.append(count)
    assert [s.matches for s in scores.scores(0)] == listed


def test_same_inputs_same_description_and_score():
    counts = CorpusCounts.of([[1, 4, 2, 4], [3, 4, 4, 9]] * 3, 12)
    arrays = (np.array([4, 4, 9, 2, 4]), np.array([1, 3, 4, START, 2]), np.array([3.0, 5.0, -1.0, 0.2, 2.0]))

    def once():
        pattern = fit_pattern(*arrays, 1, counts)
        scores = PatternScores([[pattern]], torch.tensor([[1.0]]))
        ids = torch.tensor([[1, 4, 2, 4, 9], [3, 4, 4, 9, 2]])
        scores.update(
            0,
            torch.tensor([[0.0, 3, 0, 2, -1], [0, 5, 2, -1, 0]])[..., None],
            ids,
            torch.ones(2, 5, dtype=torch.bool),
        )
        return describe(pattern, [T["capital"]], None, TEXTS), scores.scores(0)

    assert once() == once()


def test_a_patterns_dict_holds_its_fields_as_plain_lists():
    from dataclasses import asdict

    for pattern in PATTERNS:
        found = pattern.to_dict()
        assert found == asdict(pattern) and Pattern(**found) == pattern
        assert found["pairs"] is not pattern.pairs and all(
            mine is not theirs for mine, theirs in zip(found["pairs"], pattern.pairs, strict=True)
        ), "a copy: changing the dict leaves the pattern as it was"


def scores_of(score) -> tuple:
    """A ProtocolScore's six scores, in reference_scores' order."""
    names = ("pooled", "pooled_control", "random", "random_control", "auroc", "auroc_control")
    return tuple(getattr(score, name) for name in names)


def reference_scores(gather, pooled: list, random: list, key: int, control: int, threshold: float):
    """The protocol's six scores by numpy — pooled, its control, random-only, its control, AUROC, its
    control — from `gather(records, of_key)`: the match of `of_key`'s pattern and sign · m of `key` at the
    positions scored; with the pooled and the random positions' counts."""

    def pearson(x, y):
        return (
            None
            if len(y) < 2 or x.std() < 1e-6 or y.std() < 1e-6
            else round(float(np.corrcoef(x, y)[0, 1]), 4)
        )

    def auroc(x, fires):
        pairs = (x[fires][:, None] > x[~fires][None]) + 0.5 * (x[fires][:, None] == x[~fires][None])
        return round(float(pairs.mean()), 4) if pairs.size else None

    p, y = gather(pooled, key)
    c, _ = gather(pooled, control)
    rp, ry = gather(random, key)
    rc, _ = gather(random, control)
    fires = y >= threshold
    expected = (
        pearson(p, y),
        pearson(c, y),
        pearson(rp, ry),
        pearson(rc, ry),
        auroc(p, fires),
        auroc(c, fires),
    )
    return expected, len(y), len(ry)


def test_the_protocol_equals_a_hand_recomputation():
    """Both sides of every key scored by the protocol against numpy over the records by hand: each side's
    top records (its highest sign · m peak among the records that are not random), the fixed random ones,
    pooled and random-only Pearson, the AUROC of the pooled positions, and the same with the control
    key's pattern; batches in any order."""
    rng = np.random.default_rng(1)
    n_keys, n_records, top_count = len(PATTERNS), 14, 3
    sides = [[p.__class__(**{**p.to_dict(), "sign": sign}) for p in PATTERNS] for sign in POLARITIES]
    records = [rng.choice([*range(7), 1000], size=rng.integers(3, 9)).tolist() for _ in range(n_records)]
    valid = [rng.random(len(r)) > 0.2 for r in records]
    m = [rng.normal(size=(len(r), n_keys)) for r in records]
    for i, r in enumerate(records):  # plant each side's match in its coefficients, some records stronger
        match = reference_match(sides[0], [r], torch.ones(1, len(r), dtype=torch.bool))
        m[i] += (3.0 if i % 3 == 0 else 0.5) * match
    fires_at = torch.tensor([[[1.0] * n_keys], [[1.5] * n_keys]])  # [sides, layers, keys]
    random = random_records(n_records, 4)
    assert random.tolist() == random_records(n_records, 4).tolist() and len(set(random.tolist())) == 4
    control = control_keys(n_keys)
    assert sorted(control.tolist()) == list(range(n_keys)) and all(control != np.arange(n_keys))

    def batches(order):
        for chunk in np.array_split(np.array(order), 3):
            width = max(len(records[i]) for i in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mined = torch.zeros(len(chunk), width, dtype=torch.bool)
            coefficients = torch.zeros(len(chunk), width, n_keys)
            for row, i in enumerate(chunk):
                ids[row, : len(records[i])] = torch.tensor(records[i])
                mined[row, : len(records[i])] = torch.from_numpy(valid[i])
                coefficients[row, : len(records[i])] = torch.from_numpy(m[i]).float()
            yield coefficients, ids, mined, torch.from_numpy(chunk)

    top = TopRecords(1, n_keys, top_count, random, n_records)
    for coefficients, _, mined, chosen in batches(rng.permutation(n_records)):
        top.update(0, coefficients, mined, chosen)
    scores = ProtocolScores([[side] for side in sides], fires_at, top.records(), random, n_records)
    for coefficients, ids, mined, chosen in batches(rng.permutation(n_records)):
        scores.update(0, coefficients, ids, mined, chosen)

    for side, sign in enumerate(POLARITIES):
        found = scores.scores(side, 0)
        for key in range(n_keys):
            peaks = {
                i: max(sign * float(np.float32(x)) for x in m[i][valid[i], key])
                for i in range(n_records)
                if i not in random and valid[i].any()
            }
            best = sorted(peaks, key=lambda i: -peaks[i])[:top_count]
            assert set(top.records()[side, 0, :, key].tolist()) == set(best), (side, key)

            def gather(chosen, of_key, key=key, sign=sign, side=side):
                match = [
                    reference_match(sides[side], [records[i]], valid[i][None])[:, of_key] for i in chosen
                ]
                coefficient = [
                    sign * m[i][valid[i], key].astype(np.float32).astype(np.float64) for i in chosen
                ]
                return np.concatenate(match), np.concatenate(coefficient)

            pooled = sorted(best) + random.tolist()
            threshold = fires_at[side, 0, key].item()
            expected, n, n_random = reference_scores(
                gather, pooled, random.tolist(), key, control[key], threshold
            )
            got = found[key]
            assert scores_of(got) == pytest.approx(expected, abs=2e-4), (side, key)
            assert got.top_positions + got.random_positions == n and got.random_positions == n_random
            listed = sum(
                bool(valid[i][at]) and (token in pattern.final or [before, token] in pattern.pairs)
                for i in pooled
                for at, (before, token) in enumerate(zip([START, *records[i][:-1]], records[i], strict=True))
                for pattern in [sides[side][key]]
            )
            assert got.matches == listed, (side, key)
        # m was planted on the positive side: there its pattern beats its control; the negative side's
        # (the same table read against −m) is the opposite; a pattern that weighs nothing scores nothing
        assert sign * found[0].pooled > 0.2 and sign * found[0].pooled > sign * found[0].pooled_control
        assert found[4].pooled is None and found[4].matches == 0


def test_auroc_of_levels_equals_every_pair_compared():
    """The AUROC from level counts (sorted matches, running sums) equals comparing every positive position
    with every negative one, ties counted half, with many tied matches; NaN for a key without both."""
    from ffmem.engine.explanations.scoring import auroc_of_levels

    rng = np.random.default_rng(3)
    levels, keys = 9, 40
    positive = rng.integers(0, 4, (levels, keys)) * (rng.random((levels, keys)) < 0.5)  # [levels, keys]
    negative = rng.integers(0, 6, (levels, keys)) * (rng.random((levels, keys)) < 0.6)  # [levels, keys]
    positive[:, 0] = 0  # no positive: NaN
    value = rng.integers(-2, 3, (levels, keys)) * 0.5  # [levels, keys]: a match per level, tied often
    found = auroc_of_levels(*(torch.from_numpy(x).double() for x in (positive, negative, value)))
    for key in range(keys):
        pos = np.repeat(value[:, key], positive[:, key])  # every positive position's match
        neg = np.repeat(value[:, key], negative[:, key])
        if not len(pos) or not len(neg):
            assert math.isnan(found[key]), key
            continue
        pairs = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
        assert float(found[key]) == pytest.approx(pairs.mean(), abs=1e-12), key


def test_the_quadrant_scores_equal_a_hand_recomputation():
    """A gated memory's quadrant patterns scored by the protocol against numpy: each quadrant's pattern (and
    its control key's of the same quadrant) over the positions of its side's top records and the random
    records whose quadrant — 2·(gate < 0) + (input < 0), from the signs of m and x·u — is that one, against
    the quadrant's sign · m: pooled and random-only Pearson and AUROC."""
    rng = np.random.default_rng(5)
    n_keys, n_records, top_count = len(PATTERNS), 16, 3
    sides = [[p.__class__(**{**p.to_dict(), "sign": sign}) for p in PATTERNS] for sign in POLARITIES]
    quadrants = [  # quadrant → its keys' patterns, a different order of PATTERNS each, with m's sign there
        [p.__class__(**{**p.to_dict(), "sign": sign}) for p in np.roll(PATTERNS, shift)]
        for shift, sign in zip(range(4), QUADRANT_SIGNS, strict=True)
    ]
    records = [rng.choice([*range(7), 1000], size=rng.integers(4, 10)).tolist() for _ in range(n_records)]
    valid = [rng.random(len(r)) > 0.2 for r in records]
    u = [rng.normal(size=(len(r), n_keys)) for r in records]
    m = [rng.normal(size=(len(r), n_keys)) for r in records]
    for i, r in enumerate(records):  # plant pp's match in the positive coefficients
        m[i] += 2.0 * np.abs(reference_match(quadrants[0], [r], torch.ones(1, len(r), dtype=torch.bool)))
    fires_at = torch.tensor([[[1.0] * n_keys], [[0.8] * n_keys]])  # [sides, layers, keys]
    random = random_records(n_records, 5)
    control = control_keys(n_keys)

    def batch(chunk):
        width = max(len(records[i]) for i in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mined = torch.zeros(len(chunk), width, dtype=torch.bool)
        coefficients, inputs = torch.zeros(len(chunk), width, n_keys), torch.zeros(len(chunk), width, n_keys)
        for row, i in enumerate(chunk):
            ids[row, : len(records[i])] = torch.tensor(records[i])
            mined[row, : len(records[i])] = torch.from_numpy(valid[i])
            coefficients[row, : len(records[i])] = torch.from_numpy(m[i]).float()
            inputs[row, : len(records[i])] = torch.from_numpy(u[i]).float()
        return coefficients, ids, mined, torch.from_numpy(np.array(chunk)), inputs

    top = TopRecords(1, n_keys, top_count, random, n_records)
    for chunk in np.array_split(np.arange(n_records), 2):
        coefficients, _, mined, chosen, _ = batch(chunk)
        top.update(0, coefficients, mined, chosen)
    scores = ProtocolScores(
        [[side] for side in sides],
        fires_at,
        top.records(),
        random,
        n_records,
        quadrants=[[q] for q in quadrants],
    )
    for chunk in np.array_split(rng.permutation(n_records), 3):
        scores.update(0, *batch(chunk))

    matches = {  # (quadrant, record) → [valid positions, keys] each key's match there
        (number, i): reference_match(quadrants[number], [records[i]], valid[i][None])
        for number in range(4)
        for i in range(n_records)
    }
    scored = 0
    for number, sign in enumerate(QUADRANT_SIGNS):
        side = POLARITIES.index(sign)
        found = scores.quadrant_scores(number, 0)
        for key in range(n_keys):

            def gather(chosen, of_key, key=key, number=number, sign=sign):
                x, y = [], []
                for i in chosen:
                    c, v = m[i][valid[i], key].astype(np.float32), u[i][valid[i], key].astype(np.float32)
                    gate_negative = ((c < 0) & (v > 0)) | ((c > 0) & (v < 0))
                    inside = 2 * gate_negative + (v < 0) == number
                    x.append(matches[number, i][inside, of_key])
                    y.append(sign * c[inside].astype(np.float64))
                return np.concatenate(x), np.concatenate(y)

            pooled = sorted(r for r in top.records()[side, 0, :, key].tolist() if r >= 0) + random.tolist()
            threshold = fires_at[side, 0, key].item()
            expected, n, n_random = reference_scores(
                gather, pooled, random.tolist(), key, control[key], threshold
            )
            got = found[key]
            for a, b in zip(scores_of(got), expected, strict=True):
                assert (a is None) == (b is None) and (a is None or a == pytest.approx(b, abs=2e-4)), (
                    number,
                    key,
                )
            assert (got.top_positions + got.random_positions, got.random_positions) == (n, n_random)
            scored += got.pooled is not None
    assert scored >= 20
    assert scores.quadrant_scores(0, 0)[0].pooled > 0.3  # pp's planted match predicts it
