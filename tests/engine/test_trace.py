"""The live view's engine on the tiny random Llama: every number of a trace against a direct
computation from one captured forward pass; with edits, every figure against a trace computed by hand
under them (tests/hand_trace.py) and the unedited figures against one without; interventions change a
layer's FF output by exactly (m' − m)·v; greedy generation and the ablation test against plain forward
passes."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from hand_trace import trace_by_hand

from ffmem.engine.live.edited_forward import generate, intervene
from ffmem.engine.live.interventions import (
    Intervention,
    InterventionError,
    format_interventions,
    parse_interventions,
)
from ffmem.engine.live.trace import LayerReading, ablation, trace
from ffmem.engine.model.hooks import capture
from ffmem.engine.paper.cases import case_of
from ffmem.engine.values.projection import value_logits

PROMPT = "The capital of France is Paris, a city on the Seine"
TOL = 1e-4


@pytest.fixture(scope="module")
def ids(tiny):
    return tiny.tokenizer(PROMPT).input_ids


def _captured(loaded, ids):
    with torch.inference_mode(), capture(loaded.model, loaded.adapter) as captured:
        logits = loaded.model(torch.tensor([ids])).logits[0]  # [pos, vocab]
    return captured, logits


def _values(loaded, layer):
    return loaded.adapter.value_matrix(loaded.adapter.blocks(loaded.model)[layer]).detach()  # [d_ff, d]


@pytest.mark.parametrize("readout", ["norm", "raw"])
@pytest.mark.parametrize("position", [None, 3])
def test_trace_matches_a_direct_computation(tiny, ids, readout, position):
    result = trace(tiny, ids, position, memories=tiny.n_keys, readout=readout)
    captured, logits = _captured(tiny, ids)
    p = len(ids) - 1 if position is None else position
    prediction = int(logits[p].argmax())
    assert result.position == p and result.prediction == prediction and result.token_ids == ids
    probs = logits[p].softmax(-1)
    assert [c.token_id for c in result.top_tokens] == probs.topk(10).indices.tolist()
    assert [c.before for c in result.top_tokens] == pytest.approx(probs.topk(10).values.tolist(), abs=TOL)
    assert all(c.after == c.before for c in result.top_tokens)  # no edits
    with torch.inference_mode():
        for layer, row in enumerate(result.layers):
            r, y, o = (getattr(captured, f)[layer][0, p] for f in ("residual", "ff_output", "layer_output"))
            lens = value_logits(tiny, torch.stack([r, y, o]), readout)  # [3, vocab]
            assert [row.top_r, row.top_y, row.top_o] == lens.argmax(-1).tolist()
            under_r = lens[0].softmax(-1)
            assert row.final_prob == pytest.approx(float(under_r[prediction]), abs=TOL)
            assert row.final_rank == int((lens[0] > lens[0][prediction]).sum())
            assert row.settled == (row.top_r == prediction)
            assert row.case == case_of(row.top_r, row.top_y, row.top_o)
            # Every memory listed: Σ m_i·v_i is the FF output, and the ranking is |m_i|·‖v_i‖.
            m = captured.coefficients[layer][0, p]  # [d_ff]
            values = _values(tiny, layer)
            listed = torch.zeros_like(y)
            for memory in row.memories:
                assert memory.coefficient == pytest.approx(float(m[memory.key]), abs=TOL)
                assert memory.score == pytest.approx(
                    float(m[memory.key].abs() * values[memory.key].norm()), rel=1e-4
                )
                listed += memory.coefficient * values[memory.key]
            assert torch.allclose(listed, y, atol=1e-4), f"max diff {(listed - y).abs().max():.2e}"
            scores = [memory.score for memory in row.memories]
            assert scores == sorted(scores, reverse=True)


def test_heatmaps_match_a_direct_computation(tiny, ids):
    result = trace(tiny, ids)
    captured, logits = _captured(tiny, ids)
    final = logits.argmax(-1)  # [pos]
    with torch.inference_mode():
        for layer in range(tiny.n_layers):
            m = captured.coefficients[layer][0].abs()  # [pos, d_ff]
            active = (m >= m.max(-1, keepdim=True).values / 8).sum(-1)
            assert result.active[layer] == active.tolist()
            o = value_logits(tiny, captured.layer_output[layer][0], "norm")  # [pos, vocab]
            r = value_logits(tiny, captured.residual[layer][0], "norm")
            change = (o - r).gather(1, final[:, None])[:, 0]
            assert result.ff_logit[layer] == pytest.approx(change.tolist(), abs=1e-3)


def test_the_last_layer_output_is_the_prediction(tiny, ids):
    result = trace(tiny, ids)
    assert result.layers[-1].top_o == result.prediction


def test_case_labels_follow_their_definitions():
    assert case_of(5, 5, 5) == "agreement"
    assert case_of(5, 7, 5) == "residual"
    assert case_of(5, 7, 7) == "ffn"
    assert case_of(5, 7, 9) == "composition"
    assert case_of(5, 5, 9) == "composition"  # r and y agree, the sum does not


@pytest.mark.parametrize(
    "edit", [Intervention(1, 5, "off"), Intervention(1, 5, "scale", 2.5), Intervention(1, 5, "set", -3.0)]
)
def test_an_intervention_changes_the_ff_output_by_exactly_its_share(tiny, ids, edit):
    clean, _ = _captured(tiny, ids)
    with torch.inference_mode(), intervene(tiny, [edit]), capture(tiny.model, tiny.adapter) as edited:
        tiny.model(torch.tensor([ids]))
    m = clean.coefficients[1][0, :, 5]  # [pos]
    new = {"off": torch.zeros_like(m), "scale": 2.5 * m, "set": torch.full_like(m, -3.0)}[edit.mode]
    assert torch.allclose(edited.coefficients[1][0, :, 5], new)
    expected = (new - m)[:, None] * _values(tiny, 1)[5]  # [pos, d]
    change = edited.ff_output[1][0] - clean.ff_output[1][0]
    assert torch.allclose(change, expected, atol=1e-5), f"max diff {(change - expected).abs().max():.2e}"
    assert torch.equal(edited.ff_output[0][0], clean.ff_output[0][0])  # layers below are untouched
    assert not tiny.adapter.value_projection(tiny.adapter.blocks(tiny.model)[1])._forward_pre_hooks


def test_trace_with_edits_reports_both_distributions_and_generations(tiny, ids):
    edits = [Intervention(2, k, "off") for k in range(0, tiny.n_keys, 2)]
    result = trace(tiny, ids, interventions=edits, generate_tokens=5)
    _, logits = _captured(tiny, ids)
    with torch.inference_mode(), intervene(tiny, edits):
        after = tiny.model(torch.tensor([ids])).logits[0, -1].softmax(-1)
    before = logits[-1].softmax(-1)
    shown = [c.token_id for c in result.top_tokens]
    assert set(shown) == set(before.topk(10).indices.tolist()) | set(after.topk(10).indices.tolist())
    for change in result.top_tokens:
        assert change.before == pytest.approx(float(before[change.token_id]), abs=TOL)
        assert change.after == pytest.approx(float(after[change.token_id]), abs=TOL)
    assert [c.after for c in result.top_tokens] == sorted((c.after for c in result.top_tokens), reverse=True)
    captured, _ = _captured(tiny, ids)
    assert result.edited_coefficients == pytest.approx(
        [float(captured.coefficients[2][0, -1, e.key]) for e in edits]
    )
    assert result.generated == _greedy(tiny, ids, 5, [])
    assert result.generated_edited == _greedy(tiny, ids, 5, edits)


def _greedy(loaded, ids, n, edits):
    ids = list(ids)
    with torch.inference_mode(), intervene(loaded, edits):
        for _ in range(n):
            ids.append(int(loaded.model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def test_generate_is_greedy_decoding(tiny, ids):
    assert generate(tiny, ids, 6) == _greedy(tiny, ids, 6, [])


def test_memory_tokens_follow_the_sign_of_the_coefficient(tiny, ids):
    result = trace(tiny, ids, memories=6, value_tokens=4)
    with torch.inference_mode():
        for row in result.layers:
            for memory in row.memories:
                signed = _values(tiny, row.layer)[memory.key] * (1 if memory.coefficient >= 0 else -1)
                expected = value_logits(tiny, signed[None], "norm")[0].topk(4).indices.tolist()
                assert memory.tokens == expected


def test_ablation_on_prefixes_matches_plain_forward_passes(tiny):
    prefixes = [
        tiny.tokenizer(t).input_ids for t in ("The capital of", "Water boils at one hundred", "Mozart")
    ]
    targets = [[5, 9], [7, 7], [11, 3]]
    before, after = ablation(tiny, 1, 5, prefixes, targets)
    with torch.inference_mode():
        for i, prefix in enumerate(prefixes):
            clean = tiny.model(torch.tensor([prefix])).logits[0, -1].softmax(-1)
            with intervene(tiny, [Intervention(1, 5, "off")]):
                off = tiny.model(torch.tensor([prefix])).logits[0, -1].softmax(-1)
            assert before[i] == pytest.approx(clean[targets[i]].tolist(), abs=1e-5)
            assert after[i] == pytest.approx(off[targets[i]].tolist(), abs=1e-5)


def test_interventions_read_back_what_they_write():
    parsed = parse_interventions(" L2K7, l1k3*0.5 ,L0K0=-2.5e1,L1K4*-1", 3, 48)
    assert parsed == [
        Intervention(2, 7, "off"),
        Intervention(1, 3, "scale", 0.5),
        Intervention(0, 0, "set", -25.0),
        Intervention(1, 4, "scale", -1.0),
    ]
    assert format_interventions(parsed) == "L2K7,L1K3*0.5,L0K0=-25,L1K4*-1"
    assert parse_interventions(format_interventions(parsed), 3, 48) == parsed
    assert parse_interventions("", 3, 48) == [] and parse_interventions(None, 3, 48) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("L3K1", "L3K1: layer 3 does not exist; layers are 0–2"),
        ("L1K48", "L1K48: key 48 does not exist; keys are 0–47"),
        ("K1L2", "cannot read intervention 'K1L2': write L12K345 (off)"),
        ("L1K2*nan", "cannot read intervention 'L1K2*nan'"),
        ("L1K2=1e9", "L1K2=1e9: the value must lie within ±10000"),
        ("L1K2,L1K2*2", "memory L1K2 is named twice"),
        (",".join(f"L0K{i}" for i in range(65)), "at most 64 interventions at once, got 65"),
    ],
)
def test_bad_interventions_say_what_is_allowed(text, message):
    with pytest.raises(
        InterventionError, match="^" + message.replace("*", r"\*").replace("(", r"\(").replace(")", r"\)")
    ):
        parse_interventions(text, 3, 48)


def test_workers_ask_glibc_to_keep_freed_memory():
    """keep_freed_memory() sets glibc's mmap and trim thresholds (mallopt accepts both values). Its effect
    on a trace — ~11.6K page faults a trace before, none after, ratio 1.39 → 1.26 — is measured by
    bench/trace.py, not here: whether one freed block is reused at once depends on the allocator's state."""
    import platform

    from ffmem.engine.allocator import keep_freed_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert keep_freed_memory() is True


def _assert_reading(reading, hand):
    """A trace's figures (or its unedited ones) equal those computed by hand."""
    assert reading.prediction == hand.prediction
    for row, want in zip(reading.layers, hand.layers, strict=True):
        assert (row.top_r, row.top_y, row.top_o, row.case, row.settled, row.final_rank) == (
            want.top_r, want.top_y, want.top_o, want.case, want.settled, want.final_rank
        )  # fmt: skip
        assert row.final_prob == pytest.approx(want.final_prob, abs=TOL)
    assert reading.active == hand.active
    for got, want in zip(reading.ff_logit, hand.ff_logit, strict=True):
        assert got == pytest.approx(want, abs=1e-3)


EDITS = [Intervention(0, 3, "set", -20.0), Intervention(1, 7, "scale", -1.0)]


@pytest.mark.parametrize("readout", ["norm", "raw"])
@pytest.mark.parametrize(
    "edits",
    [EDITS, [Intervention(0, 5, "set", 20.0), Intervention(2, 3, "off")]],
    ids=["set-scale", "set-off"],
)
def test_with_edits_every_figure_comes_from_the_edited_pass(tiny, ids, readout, edits):
    """Issue 13: the layer table, p(final | r), rank, cases, settled and both heatmaps are those of the
    forward pass under the edits, computed here by hand; the unedited figures beside them are those of a
    trace without edits."""
    p = len(ids) - 1
    result = trace(tiny, ids, memories=tiny.n_keys, readout=readout, interventions=edits)
    edited = trace_by_hand(tiny, ids, p, readout, edits)
    _assert_reading(result, edited)
    clean = trace_by_hand(tiny, ids, p, readout)
    _assert_reading(result.unedited, clean)
    for row, want, was in zip(result.layers, edited.layers, clean.layers, strict=True):
        for memory in row.memories:  # the edited coefficients, each beside its unedited one
            assert memory.coefficient == pytest.approx(float(want.m[memory.key]), abs=TOL)
            assert memory.unedited_coefficient == pytest.approx(float(was.m[memory.key]), abs=TOL)
    plain = trace(tiny, ids, memories=tiny.n_keys, readout=readout)
    assert plain.unedited is None
    assert all(m.unedited_coefficient is None for row in plain.layers for m in row.memories)
    assert [_figures(row) for row in result.unedited.layers] == [_figures(row) for row in plain.layers]
    assert (result.unedited.active, result.unedited.ff_logit) == (plain.active, plain.ff_logit)
    # The edits change the figures (else this test could not tell the two passes apart).
    assert [_figures(row) for row in result.layers] != [_figures(row) for row in plain.layers]


def _figures(row) -> dict:
    """A layer's figures without its memories."""
    return {f.name: getattr(row, f.name) for f in fields(LayerReading)}


def test_the_edited_prediction_is_the_edited_models(tiny, ids):
    result = trace(tiny, ids, interventions=EDITS)
    edited = trace_by_hand(tiny, ids, len(ids) - 1, "norm", EDITS)
    clean = trace_by_hand(tiny, ids, len(ids) - 1, "norm")
    assert (result.prediction, result.unedited.prediction) == (edited.prediction, clean.prediction)
    assert edited.prediction != clean.prediction
    assert (
        result.layers[-1].top_o == edited.prediction and result.unedited.layers[-1].top_o == clean.prediction
    )
    for change in result.top_tokens:
        assert change.after == pytest.approx(float(edited.probs[change.token_id]), abs=TOL)
        assert change.before == pytest.approx(float(clean.probs[change.token_id]), abs=TOL)


def test_one_forward_pass_without_edits_two_with(tiny, ids):
    calls = []
    handle = tiny.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        trace(tiny, ids)
        assert len(calls) == 1
        trace(tiny, ids, interventions=EDITS)
        assert len(calls) == 3  # the edited pass and the unedited one
    finally:
        handle.remove()
