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
    input_ids = torch.tensor(sentences)
    valid = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    got = LayerPatterns(patterns).match(input_ids, valid)  # [Q, keys]
    expected = []
    for row, ids in enumerate(sentences):
        for position in range(len(ids)):
            if not valid[row, position]:
                continue
            counts = []
            for p in patterns:
                count = int(ids[position] in p.final)
                n = len(p.ngram)
                count += (
                    bool(p.ngram) and position + 1 >= n and ids[position + 1 - n : position + 1] == p.ngram
                )
                count += any(t in ids[: position + 1] for t in p.context)
                counts.append(float(count))
            expected.append(counts)
    assert got.tolist() == expected


def test_scores_equal_direct_computation():
    generator = torch.Generator().manual_seed(0)
    patterns = [[Pattern(final=[1]), Pattern(final=[2], context=[3]), Pattern(), Pattern(final=[4])]]
    fires_at = torch.tensor([[1.0, 1.5, 1.0, float("nan")]])
    scores = PatternScores(patterns, fires_at)
    all_m, all_p = [], []
    for _ in range(3):  # three batches
        input_ids = torch.randint(0, 6, (4, 9), generator=generator)
        valid = torch.rand(4, 9, generator=generator) > 0.2
        m = torch.randn(4, 9, 4, generator=generator) + (input_ids == 1)[..., None] * 2.0
        scores.update(0, m, input_ids, valid)
        all_m.append(m[valid])
        parts = LayerPatterns(patterns[0]).match(input_ids, valid)
        all_p.append(parts / torch.tensor([1.0, 2.0, 1.0, 1.0]))
    m, p = torch.cat(all_m).double().numpy(), torch.cat(all_p).double().numpy()
    found = scores.scores(0)
    for key in (0, 1):
        assert abs(found[key].correlation - np.corrcoef(p[:, key], m[:, key])[0, 1]) < 1e-4
        fires = m[:, key] >= fires_at[0, key].item()
        pos, neg = p[fires, key], p[~fires, key]
        pairwise = ((pos[:, None] > neg[None]) + 0.5 * (pos[:, None] == neg[None])).mean()
        assert abs(found[key].auroc - pairwise) < 1e-4
        assert found[key].positions == len(m) and found[key].matches == int((p[:, key] > 0).sum())
    assert found[0].correlation > 0.5  # the planted relation
    assert found[2].correlation is None and found[2].matches == 0  # no pattern: nothing to correlate
    assert found[3].auroc is None  # never fires
