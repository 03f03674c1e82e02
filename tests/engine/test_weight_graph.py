"""The weight graph equals a brute-force computation: every (earlier value, later key) pair scored one by
one from the modules' own weights, ranked by |score| with sorted(); for a gated Llama (RMSNorm) and a
plain GPT-2 (LayerNorm, centred)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from ffmem.engine.model.adapters import adapter_for
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.relations.weight_graph import top_per_column, weight_graph

N = 10


def _brute_force_llama(model) -> dict[tuple[int, int, int, int], float]:
    """score[(writer layer, j, reader layer, i)] = ‖ũ_i‖ (v_j·g̃_i) + ‖g̃_i‖ (v_j·ũ_i), g̃ = w∘g, ũ = w∘u."""
    blocks = model.model.layers
    scores = {}
    for reader, block in enumerate(blocks):
        w = block.post_attention_layernorm.weight.detach().double()
        for i in range(block.mlp.up_proj.weight.shape[0]):
            g = block.mlp.gate_proj.weight[i].detach().double() * w
            u = block.mlp.up_proj.weight[i].detach().double() * w
            for writer in range(reader):
                down = blocks[writer].mlp.down_proj.weight.detach().double()  # [d, d_ff]: column j is v_j
                for j in range(down.shape[1]):
                    v = down[:, j]
                    scores[writer, j, reader, i] = float(u.norm() * (v @ g) + g.norm() * (v @ u))
    return scores


def _brute_force_gpt2(model) -> dict[tuple[int, int, int, int], float]:
    """score = v_j·(k̃_i − mean k̃_i), k̃ = w∘k: LayerNorm subtracts the mean of its input."""
    blocks = model.transformer.h
    scores = {}
    for reader, block in enumerate(blocks):
        w = block.ln_2.weight.detach().double()
        keys = block.mlp.c_fc.weight.detach().double()  # Conv1D [d, d_ff]: column i is k_i
        for i in range(keys.shape[1]):
            k = keys[:, i] * w
            k = k - k.mean()
            for writer in range(reader):
                values = blocks[writer].mlp.c_proj.weight.detach().double()  # Conv1D [d_ff, d]: row j is v_j
                for j in range(values.shape[0]):
                    scores[writer, j, reader, i] = float(values[j] @ k)
    return scores


def _check(graph, scores: dict, n_layers: int, d_ff: int) -> None:
    for layer in range(n_layers):
        for key in range(d_ff):
            inbound = sorted(
                ((s, w, j) for (w, j, r, i), s in scores.items() if (r, i) == (layer, key)),
                key=lambda t: -abs(t[0]),
            )[:N]
            outbound = sorted(
                ((s, r, i) for (w, j, r, i), s in scores.items() if (w, j) == (layer, key)),
                key=lambda t: -abs(t[0]),
            )[:N]
            for found, expected in (
                ((graph.inbound_layer, graph.inbound_key, graph.inbound_score), inbound),
                ((graph.outbound_layer, graph.outbound_key, graph.outbound_score), outbound),
            ):
                layers, keys, values = (t[layer, key] for t in found)
                got = [(layers[s].item(), keys[s].item()) for s in range(N) if layers[s] >= 0]
                assert got == [(other_layer, other_key) for _, other_layer, other_key in expected], (
                    layer,
                    key,
                )
                want = torch.tensor([s for s, _, _ in expected], dtype=torch.float32)
                torch.testing.assert_close(values[: len(expected)], want, rtol=1e-4, atol=1e-5)
                assert (layers[len(expected) :] == -1).all()


@pytest.mark.parametrize("block_layers", [1, 2, 8])
def test_gated_scores_equal_brute_force(tiny, block_layers):
    graph = weight_graph(tiny, n=N, block_layers=block_layers)
    _check(graph, _brute_force_llama(tiny.model), tiny.n_layers, tiny.n_keys)
    assert (graph.inbound_layer[0] == -1).all() and (graph.outbound_layer[-1] == -1).all()
    assert (graph.inbound_layer[2] < 2).all() and (
        graph.outbound_layer[0][graph.outbound_layer[0] >= 0] > 0
    ).all()


def test_layernorm_scores_equal_brute_force():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_embd=16, n_inner=32, n_layer=3, n_head=2, n_positions=16)
    )
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))  # non-unit norm weights, non-zero mean keys
    loaded = LoadedModel(
        model=model.eval(),
        tokenizer=None,
        adapter=adapter_for(model),
        slug="tiny-gpt2",
        source="memory",
        revision=None,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    graph = weight_graph(loaded, n=N, block_layers=2)
    _check(graph, _brute_force_gpt2(model), 3, 32)


def test_top_per_column_is_topk():
    generator = torch.Generator().manual_seed(3)
    magnitude = torch.rand(640, 48, generator=generator)
    for n in (1, 10):
        assert torch.equal(top_per_column(magnitude, n), magnitude.topk(n, dim=0).indices)
    odd = torch.rand(33, 5, generator=generator)  # rows not a multiple of the group: plain topk
    assert torch.equal(top_per_column(odd, 4), odd.topk(4, dim=0).indices)
