"""Who pushes a token (ffmem.engine.live.attribution through ffmem.engine.live.trace) against a computation by
hand: plain PyTorch hooks on the model's own modules record m (the input of the value projection), y (the
FF's output), r and o at the position; contributions are m_i·(v_i·e_t) (raw) and m_i·(v_i·g_t) with
g_t the final norm folded at the actual final residual (norm), written here from the norm's formula,
apart from the engine. On the tiny gated Llama (RMSNorm, no biases) and a tiny GPT-2 (LayerNorm, FF
output bias, the norm's bias)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from ffmem.engine.live.attribution_terms import is_veto, target_id
from ffmem.engine.live.interventions import Intervention
from ffmem.engine.live.trace import trace
from ffmem.engine.model.adapters import adapter_for
from ffmem.engine.model.loaded import LoadedModel

PROMPT = "The capital of France is Paris, a city on the Seine"


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def by_hand(model, blocks, ids, position, edits=()):
    """Per layer at `position`: m [d_ff], y [d], r [d], o [d] from hooks on the HF modules (edits
    applied to m as the interventions say, by hand)."""
    seen = {"m": {}, "y": {}, "r": {}, "o": {}}
    handles = []
    for layer, (ff, values, block) in enumerate(blocks):

        def edit_and_keep(module, inputs, layer=layer):
            m = inputs[0].clone()  # [1, pos, d_ff]
            for e in (e for e in edits if e.layer == layer):
                m[..., e.key] = 0.0 if e.mode == "off" else m[..., e.key] * e.value
            seen["m"][layer] = m[0, position]
            return (m,)

        def keep_y(module, inputs, output, layer=layer):
            seen["y"][layer] = output[0, position]

        def keep_block(module, args, kwargs, output, layer=layer):
            x = args[0] if args else kwargs["hidden_states"]  # [1, pos, d]
            seen["o"][layer] = (output[0] if isinstance(output, tuple) else output)[0, position]
            seen["r"][layer] = None  # r = o − y for these sequential blocks after attention: below
            seen.setdefault("x", {})[layer] = x[0, position]

        handles += [
            values.register_forward_pre_hook(edit_and_keep),
            ff.register_forward_hook(keep_y),
            block.register_forward_hook(keep_block, with_kwargs=True),
        ]
    try:
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, position]  # [vocab]
    finally:
        for handle in handles:
            handle.remove()
    layers = range(len(blocks))
    stack = {name: torch.stack([seen[name][layer] for layer in layers]) for name in ("m", "y", "o")}
    stack["r"] = stack["o"] - stack["y"]  # sequential blocks: o = r + y
    return stack, logits


def llama_blocks(model):
    return [(b.mlp, b.mlp.down_proj, b) for b in model.model.layers]


def gpt2_blocks(model):
    return [(b.mlp, b.mlp.c_proj, b) for b in model.transformer.h]


@pytest.fixture(scope="module")
def gpt2():
    """A tiny GPT-2: LayerNorm (weight, bias), a bias on the FF output, Conv1D projections."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_embd=16, n_inner=32, n_layer=2, n_head=2, n_positions=32)
    model = GPT2LMHeadModel(config).float().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    adapter = adapter_for(model)
    return LoadedModel(model, None, adapter, "gpt2", "gpt2", None, torch.device("cpu"), torch.float32)


def rms_direction(model, e, x):
    """g_t for RMSNorm by its formula: scale(x_L)·w⊙e_t."""
    norm = model.model.norm
    scale = 1 / torch.sqrt(x.pow(2).mean() + norm.variance_epsilon)
    return scale * norm.weight * e


def layer_norm_direction(model, e, x):
    """g_t for LayerNorm by its formula: scale(x_L)·(w⊙e_t − mean(w⊙e_t))."""
    norm = model.transformer.ln_f
    scale = 1 / torch.sqrt(x.var(unbiased=False) + norm.eps)
    we = norm.weight * e
    return scale * (we - we.mean())


def check(result, model, values, vectors, logits, direction, readout, tol):
    """Every attributed figure of `result` against the hand computation."""
    att = result.attribution
    t = att.target
    e = model.get_output_embeddings().weight[t]  # [d]
    x = vectors["o"][-1]  # x_L
    g = e if readout == "raw" else direction(model, e, x)  # [d]
    for layer, row in enumerate(att.layers):
        v = values[layer]  # [d_ff, d]
        c = vectors["m"][layer] * (v @ g)  # [d_ff]
        bias = values_bias[layer] @ g if (values_bias := getattr(values, "biases", None)) else 0.0
        assert row.memories_sum == pytest.approx(float(c.sum()), abs=tol), f"layer {layer}"
        assert row.direct == pytest.approx(float(vectors["y"][layer] @ g), abs=tol)
        assert row.memories_sum + row.bias == pytest.approx(row.direct, abs=tol)  # Σ c_i + b·g = y·g
        if not values.biases:
            assert row.bias == 0.0 and bias == 0.0
        expected = sorted(range(len(c)), key=lambda i: -abs(float(c[i])))[: len(row.memories)]
        assert [mem.key for mem in row.memories] == expected
        for mem in row.memories:
            assert mem.contribution == pytest.approx(float(c[mem.key]), abs=tol)
            assert mem.coefficient == pytest.approx(float(vectors["m"][layer, mem.key]), abs=tol)
            assert mem.value_logit == pytest.approx(float(v[mem.key] @ g), abs=tol)
        if readout == "raw":  # the FF's change to the raw logit lens is y·e_t: the sum is exact
            assert row.change == pytest.approx(float(vectors["y"][layer] @ e), abs=tol)
            assert abs(row.residual) < tol
    total = sum(float((vectors["m"][layer] * (values[layer] @ g)).sum()) for layer in range(len(values)))
    assert att.total == pytest.approx(total, abs=tol)
    if readout == "norm":  # the model's own logit, with its constants apart, is x_L·g_t exactly
        assert att.logit == pytest.approx(float(logits[t]), abs=tol)
        assert float(logits[t]) - float(x @ g) == pytest.approx(values.constant(t), abs=tol)
    all_c = torch.cat([vectors["m"][layer] * (values[layer] @ g) for layer in range(len(values))])
    k = len(att.promoters)
    assert [p.contribution for p in att.promoters] == pytest.approx(all_c.topk(k).values.tolist(), abs=tol)
    assert all(p.contribution > 0 for p in att.promoters) and all(s.contribution < 0 for s in att.suppressors)
    assert [s.contribution for s in att.suppressors] == pytest.approx(
        (-all_c).topk(len(att.suppressors)).values.neg().tolist(), abs=tol
    )


class Values(list):
    """Each layer's value rows [d_ff, d] (by hand from the HF weights), their output biases, and the
    constant part of a target's logit (the norm's and the head's biases)."""

    def __init__(self, rows, biases, constant):
        super().__init__(rows)
        self.biases, self.constant = biases, constant


def llama_values(model):
    rows = [b.mlp.down_proj.weight.T.detach() for b in model.model.layers]  # [d_ff, d] each
    return Values(rows, [], lambda t: 0.0)


def gpt2_values(model):
    rows = [b.mlp.c_proj.weight.detach() for b in model.transformer.h]  # Conv1D weight [d_ff, d]
    biases = [b.mlp.c_proj.bias.detach() for b in model.transformer.h]
    ln = model.transformer.ln_f
    return Values(rows, biases, lambda t: float(ln.bias @ model.lm_head.weight[t]))


@pytest.mark.parametrize("readout", ["raw", "norm"])
def test_llama_contributions_equal_the_hand_computation(tiny, readout):
    ids = tiny.tokenizer(PROMPT).input_ids
    position = len(ids) - 1
    result = trace(tiny, ids, readout=readout, memories=7)
    vectors, logits = by_hand(tiny.model, llama_blocks(tiny.model), ids, position)
    assert result.attribution.target == result.prediction == int(logits.argmax())
    assert len(result.attribution.layers) == tiny.n_layers
    assert all(len(row.memories) == 7 for row in result.attribution.layers)
    check(result, tiny.model, llama_values(tiny.model), vectors, logits, rms_direction, readout, 1e-4)
    if readout == "norm":  # the norm lens reads r and o at their own scales: not the linear sum
        assert result.attribution.scale == pytest.approx(
            float(1 / torch.sqrt(vectors["o"][-1].pow(2).mean() + tiny.model.model.norm.variance_epsilon))
        )
        norm, head = tiny.model.model.norm, tiny.model.lm_head
        t = result.attribution.target
        for layer, row in enumerate(result.attribution.layers):
            lens = [float(head(norm(vectors[name][layer]))[t]) for name in ("o", "r")]
            assert row.change == pytest.approx(lens[0] - lens[1], abs=1e-4)
            assert row.residual == pytest.approx(row.change - row.memories_sum, abs=1e-4)


@pytest.mark.parametrize("readout", ["raw", "norm"])
def test_gpt2_layer_norm_and_biases(gpt2, readout):
    ids = [3, 17, 5, 40, 9, 22, 11]
    result = trace(gpt2, ids, 4, readout=readout, memories=5, target=13)
    vectors, logits = by_hand(gpt2.model, gpt2_blocks(gpt2.model), ids, 4)
    assert result.attribution.target == 13
    values = gpt2_values(gpt2.model)
    check(result, gpt2.model, values, vectors, logits, layer_norm_direction, readout, 1e-4)
    e = gpt2.model.lm_head.weight[13]
    g = e if readout == "raw" else layer_norm_direction(gpt2.model, e, vectors["o"][-1])
    for layer, row in enumerate(result.attribution.layers):
        assert row.bias == pytest.approx(float(values.biases[layer] @ g), abs=1e-5)
        assert row.bias != 0.0


def test_attribution_reads_the_edited_pass(tiny):
    """With edits the contributions are those of the edited forward pass (the one the page shows)."""
    ids = tiny.tokenizer(PROMPT).input_ids
    plain = trace(tiny, ids, readout="raw", memories=3)
    top = plain.attribution.promoters[0]
    edits = [Intervention(top.layer, top.key, "scale", -2.0)]
    target = plain.prediction
    edited = trace(tiny, ids, readout="raw", memories=3, interventions=edits, target=target)
    vectors, logits = by_hand(tiny.model, llama_blocks(tiny.model), ids, len(ids) - 1, edits)
    check(edited, tiny.model, llama_values(tiny.model), vectors, logits, rms_direction, "raw", 1e-4)
    row = edited.attribution.layers[top.layer]
    assert row.memories_sum == pytest.approx(
        plain.attribution.layers[top.layer].memories_sum - 3 * top.contribution, abs=1e-4
    )


def test_attribution_is_optional(tiny):
    ids = tiny.tokenizer(PROMPT).input_ids
    assert trace(tiny, ids, attribution=False).attribution is None


def test_veto_rule_and_target_ids():
    assert not is_veto(5.0, 0.0, 5.0, True)  # the layer does not push the target down
    assert is_veto(0.1, -1.0, 5.0, True)  # its own top token is the target
    assert is_veto(1.25, -1.0, 5.0, False) and not is_veto(1.2, -1.0, 5.0, False)  # ≥ ¼ of the largest
    assert not is_veto(-3.0, -1.0, 5.0, False)
    assert target_id("#42") == 42 and target_id("42") is None and target_id("#4 2") is None
    assert target_id(" London") is None
