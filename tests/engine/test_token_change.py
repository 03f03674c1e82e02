"""TokenChange on the tiny random Llama against a recomputation written here, apart from the engine: the whole
prefix through Hugging Face's forward with a plain hook on the layer's down projection that scales the
memory's coefficient at the last position only; and its output score against a rank correlation and overlap
computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from test_adapters import CASES, VOCAB, _tiny

from ffmem.engine.model.adapters import adapter_for
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.values.token_change import Context, control_key, output_score, token_change

SENTENCES = ["The capital of France is Paris, a city on the Seine", "Water boils at one hundred degrees"]


def _by_hand(tiny, prefix: list[int], layer: int, key: int, scale: float) -> torch.Tensor:
    """log p after the prefix, memory (layer, key) scaled at the prefix's last token only: [vocab]."""
    down = tiny.model.model.layers[layer].mlp.down_proj

    def hook(module, inputs):
        m = inputs[0].clone()  # [1, pos, d_ff]
        m[0, -1, key] *= scale
        return (m,)

    handle = down.register_forward_pre_hook(hook)
    try:
        with torch.inference_mode():
            logits = tiny.model(torch.tensor([prefix])).logits[0, -1]  # [vocab]
    finally:
        handle.remove()
    return logits.float().log_softmax(-1)


def _coefficients(tiny, ids: list[int], layer: int, key: int) -> torch.Tensor:
    """m of (layer, key) at every position: the down projection's input, [pos]."""
    captured = {}
    handle = tiny.model.model.layers[layer].mlp.down_proj.register_forward_pre_hook(
        lambda module, inputs: captured.update(m=inputs[0][0, :, key])
    )
    try:
        with torch.inference_mode():
            tiny.model(torch.tensor([ids]))
    finally:
        handle.remove()
    return captured["m"]


def test_token_change_matches_edited_forward_passes_by_hand(tiny):
    sentences = [tiny.tokenizer(s).input_ids for s in SENTENCES]
    memories = [(1, 5), (2, 40), (0, 7), (1, 9)]
    contexts = [
        [Context(0, 3), Context(1, 5), Context(0, 8)],
        [Context(1, 0), Context(0, 8)],  # position 0: nothing cached before it
        [],
        [Context(1, 6)],  # sentence 1's cache now reaches position 6: one padded pass with sentence 0's
    ]
    found = token_change(tiny, sentences, memories, contexts, factor=3.0)
    assert found.contexts == [3, 2, 0, 1]
    for row, (layer, key), wanted in ((r, memories[r], contexts[r]) for r in (0, 1, 3)):
        change, base, amplified, off = (torch.zeros(tiny.vocab_size) for _ in range(4))
        for context in wanted:
            prefix = sentences[context.sentence][: context.position + 1]
            logs = [_by_hand(tiny, prefix, layer, key, s) for s in (1.0, 3.0, 0.0)]
            change += logs[1] - logs[2]
            base, amplified, off = base + logs[0].exp(), amplified + logs[1].exp(), off + logs[2].exp()
        n = len(wanted)
        torch.testing.assert_close(found.change[row], change / n, atol=2e-5, rtol=0)
        for name, wanted_p in (("base", base), ("amplified", amplified), ("off", off)):
            torch.testing.assert_close(getattr(found, name)[row], wanted_p / n, atol=2e-6, rtol=0)
    assert min(float(found.change[row].abs().max()) for row in (0, 1)) > 1e-3  # the edit moves something
    assert not found.change[2].any()  # no contexts: zeros
    lean = token_change(tiny, sentences, memories, contexts, factor=3.0, probabilities=False)
    torch.testing.assert_close(lean.change, found.change, atol=2e-5, rtol=0)  # the change alone kept
    assert lean.base is None
    for (layer, key), wanted, read, again in zip(
        memories, contexts, found.coefficients, lean.coefficients, strict=True
    ):
        for context, m, m_again in zip(wanted, read, again, strict=True):  # m unedited at the context
            by_hand = _coefficients(tiny, sentences[context.sentence], layer, key)  # [pos]
            assert m == pytest.approx(float(by_hand[context.position]), abs=1e-5) == m_again


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_family_runs_only_the_edited_layers_and_matches_a_whole_forward(case):
    """Rows start at their chunk's lowest layer (the blocks below pass through, in each family's output
    shape: GPT-Neo's blocks return tuples) from right-aligned caches (sliding windows: GPT-Neo's local
    layer, Mistral's); a memory of layer 0 and one of layer 1 share a sentence's chunk, each equal to the
    whole prefix run with a plain hook on the value projection."""
    model = _tiny(case)
    adapter = adapter_for(model)
    loaded = LoadedModel(model, None, adapter, case.name, case.name, None, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(2)
    sentences = [torch.randint(2, VOCAB, (n,), generator=generator).tolist() for n in (9, 7)]
    memories = [(1, 3), (0, 11)]
    contexts = [[Context(0, 4), Context(1, 6)], [Context(0, 8), Context(0, 0)]]
    found = token_change(loaded, sentences, memories, contexts, factor=4.0)
    blocks = adapter.blocks(model)
    for row, (layer, key) in enumerate(memories):
        change, base = torch.zeros(VOCAB), torch.zeros(VOCAB)
        for context in contexts[row]:
            prefix = sentences[context.sentence][: context.position + 1]
            logs = []
            for scale in (4.0, 0.0, 1.0):

                def hook(module, inputs, scale=scale, key=key):
                    m = inputs[0].clone()  # [1, pos, d_ff] ([pos, d_ff] for OPT)
                    m.view(-1, m.shape[-1])[-1, key] *= scale
                    return (m,)

                with adapter.value_projection(blocks[layer]).register_forward_pre_hook(hook):
                    with torch.inference_mode():
                        logits = model(torch.tensor([prefix])).logits[0, -1]  # [vocab]
                logs.append(logits.float().log_softmax(-1))
            change, base = change + logs[0] - logs[1], base + logs[2].exp()
        torch.testing.assert_close(found.change[row], change / len(contexts[row]), atol=2e-5, rtol=0)
        torch.testing.assert_close(found.base[row], base / len(contexts[row]), atol=2e-6, rtol=0)  # unedited
    assert float(found.change.abs().max()) > 1e-3  # the edits move something (a ReLU's m can be 0)


def test_the_output_score_is_top_overlap_and_spearman():
    torch.manual_seed(1)
    change = torch.randn(200)
    logits = 0.5 * change + torch.randn(200)
    score = output_score(change, logits, top=10)
    top_a, top_b = set(change.topk(10).indices.tolist()), set(logits.topk(10).indices.tolist())
    assert score.overlap == len(top_a & top_b) / 10
    rank_a = {i: r for r, i in enumerate(sorted(range(200), key=lambda i: float(change[i])))}
    rank_b = {i: r for r, i in enumerate(sorted(range(200), key=lambda i: float(logits[i])))}
    d2 = sum((rank_a[i] - rank_b[i]) ** 2 for i in range(200))
    assert score.spearman == pytest.approx(1 - 6 * d2 / (200 * (200**2 - 1)), abs=1e-12)
    assert output_score(change, change, top=10).overlap == 1.0
    assert math.isclose(output_score(change, -change, top=10).spearman, -1.0)


def test_the_control_is_another_memory_of_the_layer():
    assert [control_key(k, 48) for k in (0, 5, 30, 47)] == [24, 29, 6, 23]
    assert all(control_key(k, n) != k for n in (2, 3, 48, 1536) for k in range(n))
