"""Explanations: the pattern read off trigger prefixes, its matching against every key at once (against
a loop over positions), and its scores (against numpy's correlation and a pairwise AUROC)."""

from __future__ import annotations

import numpy as np
import torch

from ffmem.engine.explanations import (
    LayerPatterns,
    Pattern,
    PatternScores,
    describe,
    document_frequency,
    find_pattern,
    word_like,
)

TEXTS = ["<pad>", " the", " city", " of", " Paris", " capital", " France", ".", " is", " river", "\n", " a"]
T = {text.strip() or text: i for i, text in enumerate(TEXTS)}


def test_pattern_of_prefixes():
    prefixes = [[T["the"], T["city"], T["of"], T["Paris"]]] * 6 + [
        [T["capital"], T["France"], T["is"], T["Paris"]]
    ] * 3
    prefixes += [[T["a"], T["river"]]]
    corpus = [[T["the"], T["city"], T["is"], T["."]]] * 20 + [[T["France"]]] + prefixes
    frequency = document_frequency(corpus, len(TEXTS))
    assert frequency[T["city"]] == (20 + 6) / len(corpus)
    pattern, shares = find_pattern(prefixes, frequency, word_like(TEXTS))
    assert pattern.final == [T["Paris"]]  # " river" ends one of ten: below FINAL_SHARE… and one prefix only
    assert shares["final"] == [0.9]
    assert pattern.ngram == [T["the"], T["city"], T["of"], T["Paris"]] and shares["ngram"] == [0.6]
    # " city" and " the" are everywhere in the corpus; " of" is in 60% of prefixes and rare elsewhere
    assert T["of"] in pattern.context and T["city"] not in pattern.context and T["the"] not in pattern.context
    description = describe(prefixes, [T["capital"], T["river"]], 0.8, frequency, word_like(TEXTS), TEXTS)
    assert description.text.startswith("ends in “ Paris” 90%; ends with “ the city of Paris” 60%; after ")
    assert description.text.endswith("promotes “ capital”, “ river”; shallow (shallowness 0.80)")
    assert describe(prefixes, [], None, frequency, word_like(TEXTS), TEXTS) == describe(
        prefixes, [], None, frequency, word_like(TEXTS), TEXTS
    )


def test_no_pattern():
    frequency = np.zeros(len(TEXTS))
    described = describe([[T["a"]], [T["river"]]], [], None, frequency, word_like(TEXTS), TEXTS)
    assert described.text == "no shared ending or word among its top triggers"
    assert described.pattern.parts == 0


def reference_parts(
    patterns: list[Pattern], sentences: list[list[int]], valid: torch.Tensor
) -> list[list[int]]:
    """How many parts of each pattern each valid position matches, by a loop over positions."""
    counts = []
    for row, ids in enumerate(sentences):
        for position in range(len(ids)):
            if valid[row, position]:
                counts.append([])
                for p in patterns:
                    n = len(p.ngram)
                    ngram = (
                        bool(p.ngram)
                        and position + 1 >= n
                        and ids[position + 1 - n : position + 1] == p.ngram
                    )
                    context = any(t in ids[: position + 1] for t in p.context)
                    counts[-1].append(int(ids[position] in p.final) + int(ngram) + int(context))
    return counts


def test_match_counts_each_part():
    patterns = [
        Pattern(final=[T["Paris"]]),
        Pattern(ngram=[T["city"], T["of"], T["Paris"]]),
        Pattern(context=[T["France"]]),
        Pattern(final=[T["Paris"], T["France"]], ngram=[T["of"], T["Paris"]], context=[T["capital"]]),
        Pattern(),
    ]
    sentences = [
        [T["the"], T["city"], T["of"], T["Paris"], T["is"], T["Paris"]],
        [T["France"], T["capital"], T["of"], T["Paris"], 0, 0],
    ]
    valid = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    got = LayerPatterns(patterns).match(torch.tensor(sentences), valid)  # [Q, keys]
    assert got.tolist() == reference_parts(patterns, sentences, valid)


def test_scores_equal_a_reference_computation():
    """Several batches of random tokens and coefficients against numpy on every position at once:
    n-grams sharing their ends, tokens past every n-gram's, keys that never match or never fire."""
    rng = np.random.default_rng(0)
    patterns = [
        Pattern(final=[1]),
        Pattern(final=[2, 3], context=[4]),
        Pattern(ngram=[1, 2]),
        Pattern(ngram=[5, 1, 2]),
        Pattern(ngram=[3, 5, 1, 2], context=[1000]),
        Pattern(final=[2], ngram=[3, 2], context=[6, 7]),
        Pattern(),  # no parts: matches nothing
        Pattern(final=[999], ngram=[998, 999], context=[997]),  # tokens that never occur
        Pattern(final=[1000, 0], ngram=[0, 1000]),
        Pattern(final=[4], ngram=[4, 4], context=[5, 4, 3]),
        Pattern(ngram=[1, 1, 2]),  # never before the sentence's start (at position 1 after a 1)
    ]
    frequencies = [0.05, 0.2, 0.2, 0.15, 0.05, 0.2, 0.05, 0.05, 0.05]
    fires_at = torch.tensor([[1.0, 1.5, 0.5, float("nan"), 1.0, 2.0, 1.0, 1.0, -100.0, 100.0, 1.0]])
    scores = PatternScores([patterns], fires_at)
    all_parts, all_m = [], []
    for rows, width in ((4, 9), (3, 1), (6, 15), (5, 12)):
        sentences = rng.choice([*range(8), 1000], size=(rows, width), p=frequencies).tolist()
        sentences[0][-4:] = [3, 5, 1, 2][-width:]  # the longest n-gram, where it fits
        valid = torch.from_numpy(rng.random((rows, width)) > 0.2)
        valid[:, 0] = False
        parts = reference_parts(patterns, sentences, valid)
        m = rng.normal(size=(rows, width, len(patterns))).astype(np.float32)
        m[valid.numpy()] += 3.0 * np.array(parts, dtype=np.float32).reshape(-1, len(patterns))
        scores.update(0, torch.from_numpy(m), torch.tensor(sentences), valid)
        all_parts += parts
        all_m.append(m[valid.numpy()])
    parts, m = np.array(all_parts), np.concatenate(all_m).astype(np.float64)
    shares = parts.astype(np.float32) / np.maximum([p.parts for p in patterns], 1).astype(np.float32)
    found = scores.scores(0)
    for key, score in enumerate(found):
        p = shares[:, key].astype(np.float64)
        correlation = np.corrcoef(p, m[:, key])[0, 1] if p.std() > 0 else None
        fires = m[:, key] >= fires_at[0, key].item()
        pos, neg = p[fires], p[~fires]
        pairs = (pos[:, None] > neg[None]) + 0.5 * (pos[:, None] == neg[None])  # [positives, negatives]
        auroc = pairs.mean() if pairs.size else None
        assert score.positions == len(m) and score.matches == int((parts[:, key] > 0).sum()), key
        assert score.correlation == (None if correlation is None else round(correlation, 4)), key
        assert score.auroc == (None if auroc is None else round(auroc, 4)), key
    assert found[0].correlation > 0.5  # the planted relation
    assert found[6].correlation is None and found[6].matches == 0  # no pattern: nothing to correlate
    assert found[7].correlation is None and found[7].matches == 0 and found[7].auroc is not None
    assert found[3].auroc is None and found[9].auroc is None  # never fires
    assert found[8].auroc is None  # always fires
