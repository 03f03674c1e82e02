"""The §5 analyses (ffmem.engine.paper.analyses.census) against a direct computation, prefix by prefix, with
the live view's own trace as the reference for the readouts."""

from __future__ import annotations

import pytest
import torch

from ffmem.engine.live.trace import trace
from ffmem.engine.model.hooks import capture
from ffmem.engine.paper.analyses import census
from ffmem.engine.paper.cases import CASES
from ffmem.engine.values.projection import value_logits

PREFIXES = [
    "The capital of France is",
    "Water boils at one hundred",
    "In 1969, astronauts landed on the",
    "Mozart wrote more than six hundred works of",
    "The quick brown fox",
    "Paris is a city on the Seine, famous",
]


def _value_top(tiny) -> torch.Tensor:
    """[layers, 2, d_ff]: each value's top raw token, and the top token of its negation."""
    tops = []
    with torch.inference_mode():
        for block in tiny.adapter.blocks(tiny.model):
            values = tiny.adapter.value_matrix(block)  # [d_ff, d]
            tops.append(torch.stack([value_logits(tiny, v, "raw").argmax(-1) for v in (values, -values)]))
    return torch.stack(tops)


@pytest.mark.parametrize("batch", [1, 4])
def test_census_equals_a_prefix_by_prefix_computation(tiny, batch):
    prefixes = [tiny.tokenizer(text).input_ids for text in PREFIXES]
    value_top = _value_top(tiny)
    stop_ids = {prefixes[0][0], prefixes[1][0]}  # a made-up stop list: "The", "Water"
    got = census(tiny, prefixes, value_top, stop_ids, batch=batch)
    n, layers = len(prefixes), tiny.n_layers
    expected = {
        name: [0.0] * layers
        for name in ("positive", "active", "composition", "agree", "stop", "settled", "prob")
    }
    cases = {case: [0.0] * layers for case in CASES}
    for ids in prefixes:
        t = trace(tiny, ids)
        with torch.inference_mode(), capture(tiny.model, tiny.adapter, fields=("coefficients",)) as captured:
            tiny.model(torch.tensor([ids]))
        for layer, row in enumerate(t.layers):
            m = captured.coefficients[layer][0, -1]  # [d_ff]
            active = m.abs() >= m.abs().max() / 8
            expected["positive"][layer] += int((m > 0).sum())
            expected["active"][layer] += int(active.sum())
            tops = {
                int(value_top[layer, 0 if m[k] >= 0 else 1, k]) for k in torch.nonzero(active)[:, 0].tolist()
            }
            agrees = row.top_y in tops
            expected["composition"][layer] += not agrees
            expected["agree"][layer] += agrees
            expected["stop"][layer] += agrees and row.top_y in stop_ids
            expected["settled"][layer] += row.settled
            expected["prob"][layer] += row.final_prob
            cases[row.case][layer] += 1
    assert got.examples == n
    assert got.positive == pytest.approx([v / n for v in expected["positive"]])
    assert got.active == pytest.approx([v / n for v in expected["active"]])
    assert got.no_memory_agrees == pytest.approx([v / n for v in expected["composition"]])
    assert got.settled == pytest.approx([v / n for v in expected["settled"]])
    assert got.final_prob == pytest.approx([v / n for v in expected["prob"]], abs=1e-5)
    assert got.stop_words == [
        None if a == 0 else pytest.approx(s / a)
        for s, a in zip(expected["stop"], expected["agree"], strict=True)
    ]
    assert got.cases == {case: pytest.approx([v / n for v in counts]) for case, counts in cases.items()}
    assert all(sum(got.cases[c][layer] for c in CASES) == pytest.approx(1.0) for layer in range(layers))


def test_token_removal_equals_single_forward_passes(tiny):
    from ffmem.engine.paper.analyses import token_removal

    prefixes = [tiny.tokenizer(text).input_ids for text in PREFIXES[:4]] + [[7]]
    items = [
        (layer, key, prefix)
        for layer, key, prefix in zip([0, 1, 2, 1, 0], [3, 40, 7, 11, 5], prefixes, strict=True)
    ]
    first, last = token_removal(tiny, items, batch=3)

    def m(layer, key, ids):
        with (
            torch.inference_mode(),
            capture(tiny.model, tiny.adapter, [layer], ("coefficients",)) as captured,
        ):
            tiny.model(torch.tensor([ids]))
        return float(captured.coefficients[layer][0, -1, key])

    for (layer, key, prefix), got_first, got_last in zip(items[:4], first, last, strict=False):
        full = m(layer, key, prefix)
        assert got_first == pytest.approx((m(layer, key, prefix[1:]) - full) / abs(full), rel=1e-4, abs=1e-5)
        assert got_last == pytest.approx((m(layer, key, prefix[:-1]) - full) / abs(full), rel=1e-4, abs=1e-5)
    assert (first[4], last[4]) == (None, None)  # one token: nothing to remove


def test_token_removal_batches_by_layer_and_stops_after_it(tiny):
    """Each batch holds one layer's prefixes; layers above it never run; progress is reported."""
    from ffmem.engine.paper.analyses import token_removal

    prefixes = [tiny.tokenizer(text).input_ids for text in PREFIXES[:3]]
    items = [(0, 3, prefixes[0]), (1, 5, prefixes[1]), (0, 8, prefixes[2])]
    blocks = tiny.adapter.blocks(tiny.model)
    ran = {index: 0 for index in range(len(blocks))}  # blocks entered
    handles = [
        block.register_forward_pre_hook(
            lambda module, args, index=index: ran.__setitem__(index, ran[index] + 1)
        )
        for index, block in enumerate(blocks)
    ]
    reports = []
    try:
        token_removal(tiny, items, batch=4, on_batch=lambda done, total: reports.append((done, total)))
    finally:
        for handle in handles:
            handle.remove()
    # Layer 0: 2 prefixes × 2 runs = 4 rows, one batch; layer 1: 2 rows, one batch.
    assert reports == [(1, 2), (2, 2)]
    assert ran[0] == 2 and ran[1] == 1  # block 0 in both batches, block 1 only in layer 1's
    assert all(ran[index] == 0 for index in range(2, len(blocks)))
