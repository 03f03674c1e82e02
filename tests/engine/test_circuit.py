"""A prompt's memory circuit (ffmem.engine.live.circuit) against computations written here, apart from the
engine.

1. Parity: every edge term m_j·(v_j·ρ_i) equals a recomputation from the HF modules' raw weights and the
   residuals captured by plain hooks, with ρ_i = J_N(x)ᵀ q_i: the FF's derivative q_i written from the
   activation's formula (SiLU, GPT-2's tanh GELU) and the norm's Jacobian taken by autograd of the norm's
   formula (RMSNorm; LayerNorm with its centring); the kept edges are the top |term| found with sorted().
2. Linearisation: the term is the derivative of m_i with respect to a relative change of m_j along the
   direct path — a forward pass with m_j scaled by 1 ± ε and everything between frozen to the clean pass
   (attention outputs of the blocks after j's, the FF outputs between), central differences, in float64.
On the tiny gated Llama (RMSNorm, SiLU, no biases) and a tiny GPT-2 (LayerNorm, tanh GELU, biases)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from ffmem.engine.live.circuit import circuit
from ffmem.engine.live.interventions import Intervention
from ffmem.engine.live.trace import trace
from ffmem.engine.model.adapters import adapter_for
from ffmem.engine.model.loaded import LoadedModel

PROMPT = "The capital of France is Paris, a city on the Seine"
GPT2_IDS = [3, 17, 5, 40, 9, 22, 11]


@pytest.fixture(scope="module")
def gpt2():
    """A tiny GPT-2 in float64: LayerNorm (weight, bias), GELU (tanh), biases on both FF projections."""
    torch.manual_seed(1)
    config = GPT2Config(vocab_size=64, n_embd=16, n_inner=32, n_layer=3, n_head=2, n_positions=32)
    model = GPT2LMHeadModel(config).double().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    return LoadedModel(
        model, None, adapter_for(model), "gpt2", "gpt2", None, torch.device("cpu"), torch.float64
    )


@pytest.fixture(scope="module")
def llama(tiny):
    """The tiny Llama in float64 (finite differences need the precision)."""
    model = copy.deepcopy(tiny.model).double().eval()
    return LoadedModel(
        model, tiny.tokenizer, tiny.adapter, "tiny", "tiny", None, torch.device("cpu"), torch.float64
    )


class Parts:
    """Where a family keeps its modules, named here by hand."""

    def __init__(self, blocks, norm, attention, mlp, values):
        self.blocks, self.norm, self.attention, self.mlp, self.values = blocks, norm, attention, mlp, values


def llama_parts(model) -> Parts:
    return Parts(model.model.layers, "post_attention_layernorm", "self_attn", "mlp", "down_proj")


def gpt2_parts(model) -> Parts:
    return Parts(model.transformer.h, "ln_2", "attn", "mlp", "c_proj")


def silu(a):
    return a / (1 + torch.exp(-a))


def gelu_tanh(a):
    return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))


def slope(act, a):
    """act'(a), elementwise, by autograd of the formula."""
    point = a.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(act(point).sum(), point)
    return grad


def forward(model, parts: Parts, ids, scale=None, frozen=None):
    """One pass: per layer, x (the FF norm's input), m (the value projection's input), the attention and
    FF outputs, all [pos, ·]. `scale` = (layer, key, factor) multiplies m_j; `frozen` = (from, to, clean):
    the attention outputs of blocks from+1 … to and the FF outputs of blocks from+1 … to−1 are replaced by
    the clean pass's."""
    seen = {"x": {}, "m": {}, "attention": {}, "ff": {}}
    handles = []
    for layer, block in enumerate(parts.blocks):
        mlp = getattr(block, parts.mlp)

        def keep_x(module, args, layer=layer):
            seen["x"][layer] = args[0][0]

        def keep_m(module, args, layer=layer):
            m = args[0].clone()
            if scale and scale[0] == layer:
                m[..., scale[1]] *= scale[2]
            seen["m"][layer] = m[0]
            return (m,)

        def attention(module, args, output, layer=layer):
            out = output[0] if isinstance(output, tuple) else output
            seen["attention"][layer] = out[0]
            if frozen and frozen[0] < layer <= frozen[1]:
                clean = frozen[2]["attention"][layer][None]
                return (clean, *output[1:]) if isinstance(output, tuple) else clean
            return None

        def ff(module, args, output, layer=layer):
            seen["ff"][layer] = output[0]
            if frozen and frozen[0] < layer < frozen[1]:
                return frozen[2]["ff"][layer][None]
            return None

        handles += [
            getattr(block, parts.norm).register_forward_pre_hook(keep_x),
            getattr(mlp, parts.values).register_forward_pre_hook(keep_m),
            getattr(block, parts.attention).register_forward_hook(attention),
            mlp.register_forward_hook(ff),
        ]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def llama_read(model, layer, key, x):
    """ρ = J_N(x)ᵀ q for key `key` of `layer`: SiLU gate times up, RMSNorm."""
    block = model.model.layers[layer]
    norm = block.post_attention_layernorm

    def normed(v):
        return norm.weight * v / torch.sqrt(v.pow(2).mean() + norm.variance_epsilon)

    g, u = block.mlp.gate_proj.weight[key], block.mlp.up_proj.weight[key]
    x_hat = normed(x)
    a, b = x_hat @ g, x_hat @ u
    q = slope(silu, a) * b * g + silu(a) * u
    jacobian = torch.autograd.functional.jacobian(normed, x)  # [d, d]
    return jacobian.T @ q


def gpt2_read(model, layer, key, x):
    """ρ = J_N(x)ᵀ q: GELU (tanh) of x̂·k + b, LayerNorm with its centring and bias."""
    block = model.transformer.h[layer]
    norm = block.ln_2

    def normed(v):
        centred = v - v.mean()
        return norm.weight * centred / torch.sqrt(centred.pow(2).mean() + norm.eps) + norm.bias

    k, bias = block.mlp.c_fc.weight[:, key], block.mlp.c_fc.bias[key]  # Conv1D [d, d_ff]: column i is k_i
    q = slope(gelu_tanh, normed(x) @ k + bias) * k
    jacobian = torch.autograd.functional.jacobian(normed, x)
    return jacobian.T @ q


def llama_values(model, layer):
    return model.model.layers[layer].mlp.down_proj.weight.T  # [d_ff, d]


def gpt2_values(model, layer):
    return model.transformer.h[layer].mlp.c_proj.weight  # Conv1D [d_ff, d]


FAMILIES = {
    "llama": (llama_parts, llama_read, llama_values),
    "gpt2": (gpt2_parts, gpt2_read, gpt2_values),
}


def prompt_of(name, loaded):
    return loaded.tokenizer(PROMPT).input_ids if name == "llama" else GPT2_IDS


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("hops", [1, 2])
def test_edge_terms_equal_the_hand_computation(request, name, hops):
    loaded = request.getfixturevalue(name)
    parts_of, read, values = FAMILIES[name]
    ids, position, top = prompt_of(name, loaded), 4, 6
    found = circuit(loaded, ids, position, readout="norm", nodes=5, top=top, threshold=0.0, hops=hops)
    seen = forward(loaded.model, parts_of(loaded.model), ids)
    m = {layer: seen["m"][layer][position].double() for layer in seen["m"]}
    x = {layer: seen["x"][layer][position].double() for layer in seen["x"]}

    # Hop 0: the attribution's five largest |c| (ffmem.engine.live.attribution, checked by its own tests).
    attribution = trace(loaded, ids, position, readout="norm", memories=5).attribution
    assert found.target == attribution.target and found.logit == pytest.approx(attribution.logit)
    pushing = sorted(attribution.promoters + attribution.suppressors, key=lambda c: -abs(c.contribution))[:5]
    nodes = {(n.layer, n.key): n for n in found.nodes}
    assert [(n.layer, n.key) for n in found.nodes if n.hop == 0] == [(c.layer, c.key) for c in pushing]
    for c in pushing:
        assert nodes[c.layer, c.key].contribution == pytest.approx(c.contribution, rel=1e-4, abs=1e-6)

    by_node: dict[tuple[int, int], list] = {}
    for edge in found.edges:
        by_node.setdefault((edge.downstream.layer, edge.downstream.key), []).append(edge)
    expanded = [n for n in found.nodes if n.upstream_sum is not None]
    assert {n.hop for n in expanded} == set(range(hops))
    for node in expanded:
        rho = read(loaded.model, node.layer, node.key, x[node.layer])  # [d]
        terms = [
            (float(m[layer][j] * (values(loaded.model, layer)[j].detach().double() @ rho)), layer, j)
            for layer in range(node.layer)
            for j in range(loaded.n_keys)
        ]
        assert node.coefficient == pytest.approx(float(m[node.layer][node.key]), rel=1e-5)
        assert node.upstream_sum == pytest.approx(sum(t for t, *_ in terms), rel=1e-4, abs=1e-6)
        expected = sorted(terms, key=lambda t: -abs(t[0]))[:top]
        edges = by_node.get((node.layer, node.key), [])
        assert [(e.upstream.layer, e.upstream.key) for e in edges] == [(layer, j) for _, layer, j in expected]
        for edge, (term, *_) in zip(edges, expected, strict=True):
            assert edge.term == pytest.approx(term, rel=1e-4, abs=1e-6)
            assert edge.coefficient == pytest.approx(node.coefficient)
        if node.layer == 0:
            assert edges == [] and node.upstream_sum == 0.0
    for edge in found.edges:  # every upstream memory is a node, one hop further
        up = nodes[edge.upstream.layer, edge.upstream.key]
        assert up.hop <= nodes[edge.downstream.layer, edge.downstream.key].hop + 1
        assert edge.upstream.layer < edge.downstream.layer
        assert up.coefficient == pytest.approx(float(m[up.layer][up.key]), rel=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_threshold_keeps_the_edges_of_each_hop_above_its_share_of_the_largest(request, name):
    loaded = request.getfixturevalue(name)
    ids = prompt_of(name, loaded)
    every = circuit(loaded, ids, nodes=4, top=8, threshold=0.0, hops=2)
    pruned = circuit(loaded, ids, nodes=4, top=8, threshold=0.3, hops=1)
    hop_of = {(n.layer, n.key): n.hop for n in every.nodes}
    first = [e for e in every.edges if hop_of[e.downstream.layer, e.downstream.key] == 0]
    largest = max(abs(e.term) for e in first)
    assert every.largest_terms[0] == pytest.approx(largest) == pytest.approx(pruned.largest_terms[0])
    expected = [(e.upstream, e.downstream) for e in first if abs(e.term) >= 0.3 * largest]
    assert [(e.upstream, e.downstream) for e in pruned.edges] == expected
    assert len(expected) < len(first)  # else this test could not tell them apart
    assert len(every.largest_terms) == 2 and {n.hop for n in every.nodes} == {0, 1, 2}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_term_is_the_first_order_change_along_the_direct_path(request, name):
    """(m_i(1 + ε) − m_i(1 − ε)) / 2ε with m_j scaled by 1 ± ε, the blocks between frozen: = term_ji."""
    loaded = request.getfixturevalue(name)
    parts_of, *_ = FAMILIES[name]
    parts = parts_of(loaded.model)
    ids, position, eps = prompt_of(name, loaded), 4, 1e-2  # Llama's RMSNorm runs in float32
    found = circuit(loaded, ids, position, nodes=4, top=3, threshold=0.0)
    clean = forward(loaded.model, parts, ids)
    checked = 0
    for edge in found.edges:
        (j_layer, j), (i_layer, i) = (
            (edge.upstream.layer, edge.upstream.key),
            (edge.downstream.layer, edge.downstream.key),
        )
        moved = [
            forward(loaded.model, parts, ids, (j_layer, j, 1 + s * eps), (j_layer, i_layer, clean))["m"][
                i_layer
            ][position, i]
            for s in (1, -1)
        ]
        derivative = float(moved[0] - moved[1]) / (2 * eps)
        assert derivative == pytest.approx(edge.term, rel=1e-3, abs=1e-6), (edge, derivative)
        checked += 1
    assert checked >= 6


def test_the_circuit_reads_the_edited_pass(llama):
    """With an edit, the coefficients are those of the edited forward pass."""
    ids = prompt_of("llama", llama)
    plain = circuit(llama, ids, nodes=3, readout="raw")  # raw: v·e_t does not move with the edit
    top = plain.nodes[0]
    edits = [Intervention(top.layer, top.key, "scale", 2.0)]
    edited = circuit(llama, ids, nodes=3, readout="raw", interventions=edits, target=plain.target)
    again = {(n.layer, n.key): n for n in edited.nodes}
    assert again[top.layer, top.key].coefficient == pytest.approx(2 * top.coefficient)
    assert again[top.layer, top.key].contribution == pytest.approx(2 * top.contribution)
