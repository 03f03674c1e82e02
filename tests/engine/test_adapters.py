"""Adapter parity: the memories `capture` reads off a tiny random model recompose its real forward pass.

Per supported Hugging Face class, one forward pass through a 2-layer model whose every parameter
(biases and norm weights included) is randomized, on a batch whose second row is right-padded:
(a) Σ_i m_i·v_i + b = y, (b) m from the keys by hand, (c) r + y = o and ff_norm(r) = FF input
(sequential) or r = block input + attention (parallel), (d) final norm + unembedding of the last o
= logits, (e) no hook outlives `capture`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTJConfig,
    GPTJForCausalLM,
    GPTNeoConfig,
    GPTNeoForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.activations import ACT2FN

from ffmem.engine.live.trace import trace
from ffmem.engine.model.adapters import ADAPTERS, UnsupportedArchitecture, adapter_for
from ffmem.engine.model.adapters.base import resolve
from ffmem.engine.model.hooks import Captured, capture
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.values.projection import norm_parts, value_logits

VOCAB, D, D_FF, LAYERS, HEADS = 128, 32, 64, 2, 4
BATCH, POS = 2, 6
TOL = 1e-5
TOKENS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=1)  # inside the tiny vocabulary
LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=D,
    intermediate_size=D_FF,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=2,
    max_position_embeddings=32,
    **TOKENS,
)


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    build: Callable[[], PreTrainedModel]
    attention: str | None = None  # block → attention module, for the parallel-block check of r


def _neox(parallel: bool) -> PreTrainedModel:
    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=D,
            intermediate_size=D_FF,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=32,
            use_parallel_residual=parallel,
            **TOKENS,
        )
    )


CASES = [
    Case(
        "gpt2",
        "gpt2",
        lambda: GPT2LMHeadModel(
            GPT2Config(
                vocab_size=VOCAB,
                n_embd=D,
                n_inner=D_FF,
                n_layer=LAYERS,
                n_head=HEADS,
                n_positions=32,
                activation_function="gelu_new",
                **TOKENS,
            )
        ),
    ),
    Case(
        "gpt_neo",
        "gpt_neo",
        lambda: GPTNeoForCausalLM(
            GPTNeoConfig(
                vocab_size=VOCAB,
                hidden_size=D,
                intermediate_size=D_FF,
                num_layers=LAYERS,
                num_heads=HEADS,
                attention_types=[[["global", "local"], 1]],
                window_size=4,  # < POS, so the local layer really is local
                max_position_embeddings=32,
                **TOKENS,
            )
        ),
    ),
    Case(
        "gptj",
        "gptj",
        lambda: GPTJForCausalLM(
            GPTJConfig(
                vocab_size=VOCAB,
                n_embd=D,
                n_inner=D_FF,
                n_layer=LAYERS,
                n_head=HEADS,
                rotary_dim=4,  # rotary on part of each 8-wide head, as in GPT-J-6B
                n_positions=32,
                **TOKENS,
            )
        ),
        attention="attn",
    ),
    Case("gpt_neox_parallel", "gpt_neox", lambda: _neox(parallel=True), attention="attention"),
    Case("gpt_neox_sequential", "gpt_neox", lambda: _neox(parallel=False)),
    Case("llama", "llama", lambda: LlamaForCausalLM(LlamaConfig(**LLAMA_LIKE))),
    Case("mistral", "llama", lambda: MistralForCausalLM(MistralConfig(sliding_window=4, **LLAMA_LIKE))),
    Case("qwen2", "llama", lambda: Qwen2ForCausalLM(Qwen2Config(**LLAMA_LIKE))),
    Case("qwen3", "llama", lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=8, **LLAMA_LIKE))),
    Case(
        "opt",
        "opt",
        lambda: OPTForCausalLM(
            OPTConfig(
                vocab_size=VOCAB,
                hidden_size=D,
                ffn_dim=D_FF,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                max_position_embeddings=32,
                **TOKENS,
            )
        ),
    ),
]


def _tiny(case: Case) -> PreTrainedModel:
    torch.manual_seed(0)
    model = case.build().float().eval()
    with torch.no_grad():  # zero biases and unit norms at init would hide bias and norm bugs
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a - b).abs().max().item()


@dataclass
class Run:
    case: Case
    model: PreTrainedModel
    captured: Captured
    ff_inputs: dict[int, torch.Tensor]  # x, the keys' input: [batch, pos, d]
    block_inputs: dict[int, torch.Tensor]  # the residual entering the block: [batch, pos, d]
    attention: dict[int, torch.Tensor]  # attention output (parallel cases): [batch, pos, d]
    logits: torch.Tensor  # [batch, pos, vocab]

    @property
    def adapter(self):
        return adapter_for(self.model)

    def blocks(self) -> list[nn.Module]:
        return self.adapter.blocks(self.model)


def _inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(2, VOCAB, (BATCH, POS), generator=generator)  # [batch, pos]
    attention_mask = torch.ones(BATCH, POS, dtype=torch.long)  # [batch, pos]
    attention_mask[1, -2:] = 0  # right-pad the second row
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.fixture(scope="module", params=CASES, ids=[case.name for case in CASES])
def run(request) -> Run:
    case: Case = request.param
    model = _tiny(case)
    adapter = adapter_for(model)
    ff_inputs, block_inputs, attention = {}, {}, {}

    def hooks_for(layer: int):
        def ff_input(module, args):
            ff_inputs[layer] = args[0]  # x: [batch, pos, d] ([batch·pos, d] in OPT)

        def block_input(module, args, kwargs):
            block_inputs[layer] = args[0] if args else kwargs["hidden_states"]  # [batch, pos, d]

        def attention_output(module, args, output):
            attention[layer] = _first(output)  # [batch, pos, d]

        return ff_input, block_input, attention_output

    handles = []
    for layer, block in enumerate(adapter.blocks(model)):
        ff_input, block_input, attention_output = hooks_for(layer)
        handles.append(resolve(block, adapter.keys).register_forward_pre_hook(ff_input))
        handles.append(block.register_forward_pre_hook(block_input, with_kwargs=True))
        if case.attention:
            handles.append(resolve(block, case.attention).register_forward_hook(attention_output))
    try:
        with capture(model, adapter) as captured, torch.no_grad():
            logits = model(**_inputs()).logits  # [batch, pos, vocab]
    finally:
        for handle in handles:
            handle.remove()
    # OPT hands its FF [batch·pos, d] rows; give x the [batch, pos, d] shape the captured tensors have.
    ff_inputs = {layer: x.reshape(BATCH, POS, -1) for layer, x in ff_inputs.items()}  # [batch, pos, d]
    return Run(case, model, captured, ff_inputs, block_inputs, attention, logits)


def test_adapter_family(run: Run):
    assert run.adapter.family == run.case.family
    assert sorted(run.captured.coefficients) == list(range(LAYERS))
    for layer in range(LAYERS):
        assert run.captured.coefficients[layer].shape == (BATCH, POS, D_FF)
        for name in ("ff_output", "residual", "layer_output"):
            assert getattr(run.captured, name)[layer].shape == (BATCH, POS, D), name


def test_values_recompose_ff_output(run: Run):
    """(a) y = Σ_i m_i·v_i + b: the FF output is the coefficient-weighted sum of the values."""
    for layer, block in enumerate(run.blocks()):
        m = run.captured.coefficients[layer]  # [batch, pos, d_ff]
        V = run.adapter.value_matrix(block)  # [d_ff, d]
        assert V.shape == (D_FF, D)
        b = run.adapter.value_bias(block)  # [d] or None
        y = m @ V + (0 if b is None else b)  # [batch, pos, d]
        diff = _max_diff(y, run.captured.ff_output[layer])
        assert diff < TOL, f"layer {layer}: max |Σ m·v + b − y| = {diff}"


def test_coefficients_from_keys(run: Run):
    """(b) m = act(x·Kᵀ + b_k), or act(x·Gᵀ + b_g) * (x·Kᵀ + b_k) for gated FFs."""
    act = ACT2FN[run.adapter.activation(run.model.config)]
    for layer, block in enumerate(run.blocks()):
        x = run.ff_inputs[layer]  # [batch, pos, d]
        K = run.adapter.key_matrix(block)  # [d_ff, d]
        assert K.shape == (D_FF, D)
        b_k = resolve(block, run.adapter.keys).bias  # [d_ff] or None
        keys = x @ K.T + (0 if b_k is None else b_k)  # [batch, pos, d_ff]
        G = run.adapter.gate_matrix(block)  # [d_ff, d] or None
        if G is None:
            m = act(keys)  # [batch, pos, d_ff]
        else:
            b_g = resolve(block, run.adapter.gates).bias  # [d_ff] or None
            m = act(x @ G.T + (0 if b_g is None else b_g)) * keys  # [batch, pos, d_ff]
        diff = _max_diff(m, run.captured.coefficients[layer])
        assert diff < TOL, f"layer {layer}: max |act(x·K) − m| = {diff}"


def test_residual(run: Run):
    """(c) sequential: r + y = o and ff_norm(r) = x; parallel: r = block input + attention output."""
    parallel = run.adapter.parallel(run.model.config)
    assert parallel == (run.case.attention is not None)
    for layer, block in enumerate(run.blocks()):
        r = run.captured.residual[layer]  # [batch, pos, d]
        if parallel:
            expected = run.block_inputs[layer] + run.attention[layer]  # [batch, pos, d]
            diff = _max_diff(r, expected)
            assert diff < TOL, f"layer {layer}: max |r − (input + attention)| = {diff}"
            continue
        y = run.captured.ff_output[layer]  # [batch, pos, d]
        diff = _max_diff(r + y, run.captured.layer_output[layer])
        assert diff < TOL, f"layer {layer}: max |r + y − o| = {diff}"
        norm = resolve(block, run.adapter.ff_norm)
        with torch.no_grad():
            diff = _max_diff(norm(r), run.ff_inputs[layer])
        assert diff < TOL, f"layer {layer}: max |ff_norm(r) − x| = {diff}"


def test_unembedding_path(run: Run):
    """(d) E·final_norm(o of the last layer) = the model's logits."""
    o = run.captured.layer_output[LAYERS - 1]  # [batch, pos, d]
    with torch.no_grad():
        normed = resolve(run.model, run.adapter.final_norm)(o)  # [batch, pos, d]
        logits = resolve(run.model, run.adapter.unembedding)(normed)  # [batch, pos, vocab]
    diff = _max_diff(logits, run.logits)
    assert diff < TOL, f"max |E·norm(o) − logits| = {diff}"


def test_norm_parts_recompose_the_final_norm(run: Run):
    """final_norm(x) = linear(x)·scale(x) + bias, and linear(r + y) = linear(r) + linear(y)."""
    loaded = LoadedModel(
        run.model, None, run.adapter, run.case.name, run.case.name, None, torch.device("cpu"), torch.float32
    )
    r, y = run.captured.residual[0][0], run.captured.ff_output[0][0]  # [pos, d]
    with torch.no_grad():
        linear, scale, bias = norm_parts(loaded, r + y)
        direct = resolve(run.model, run.adapter.final_norm)(r + y)  # [pos, d]
        assert _max_diff(linear * scale + (0 if bias is None else bias), direct) < TOL
        assert _max_diff(norm_parts(loaded, r)[0] + norm_parts(loaded, y)[0], linear) < TOL


@pytest.mark.parametrize("readout", ["norm", "raw"])
def test_trace_reads_every_layer_as_the_direct_readout(run: Run, readout: str):
    """The trace's split readout (o from r and y) picks the tokens a direct readout of r, y, o picks."""
    loaded = LoadedModel(
        run.model, None, run.adapter, run.case.name, run.case.name, None, torch.device("cpu"), torch.float32
    )
    ids = _inputs()["input_ids"][0].tolist()
    result = trace(loaded, ids, 3, readout=readout)
    with torch.no_grad(), capture(run.model, run.adapter) as captured:
        logits = run.model(torch.tensor([ids])).logits[0]  # [pos, vocab]
    assert result.prediction == int(logits[3].argmax())
    for layer, row in enumerate(result.layers):
        vectors = torch.stack(
            [getattr(captured, f)[layer][0, 3] for f in ("residual", "ff_output", "layer_output")]
        )
        with torch.no_grad():
            lens = value_logits(loaded, vectors, readout)  # [3, vocab]
        assert [row.top_r, row.top_y, row.top_o] == lens.argmax(-1).tolist(), f"layer {layer}"
        assert row.final_prob == pytest.approx(float(lens[0].softmax(-1)[result.prediction]), abs=1e-5)


def _hooks(model: nn.Module) -> list[str]:
    """Names of the modules that hold a forward hook or forward pre-hook."""
    return [
        name for name, module in model.named_modules() if module._forward_hooks or module._forward_pre_hooks
    ]


def test_hooks_removed(run: Run):
    """(e) capture leaves no hook behind, on a normal exit and after an exception."""
    assert _hooks(run.model) == []
    with capture(run.model, run.adapter), torch.no_grad():
        assert _hooks(run.model), "capture registered no hooks"
        run.model(**_inputs())
    assert _hooks(run.model) == []
    with pytest.raises(RuntimeError, match="boom"), capture(run.model, run.adapter):
        assert _hooks(run.model)
        raise RuntimeError("boom")
    assert _hooks(run.model) == []


def test_capture_subset_of_layers_and_fields(run: Run):
    """Only the asked layers and fields are stored, with the same values as a full capture."""
    with torch.no_grad(), capture(run.model, run.adapter, layers=[1], fields=["coefficients"]) as captured:
        run.model(**_inputs())
    assert sorted(captured.coefficients) == [1]
    assert not captured.ff_output and not captured.residual and not captured.layer_output
    diff = _max_diff(captured.coefficients[1], run.captured.coefficients[1])
    assert diff == 0, f"max |m(subset) − m(full)| = {diff}"


def test_capture_rejects_unknown_field():
    model = _tiny(CASES[0])
    with pytest.raises(ValueError, match="keys"):
        with capture(model, adapter_for(model), fields=["keys"]):
            pass
    assert _hooks(model) == []


def test_registry_covers_the_supported_classes():
    assert set(ADAPTERS) == {
        "GPT2LMHeadModel",
        "GPTNeoForCausalLM",
        "GPTJForCausalLM",
        "GPTNeoXForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "OPTForCausalLM",
    }


def test_unsupported_architecture_lists_supported_classes():
    class MysteryForCausalLM(nn.Module):
        pass

    with pytest.raises(UnsupportedArchitecture) as error:
        adapter_for(MysteryForCausalLM())
    message = str(error.value)
    assert "MysteryForCausalLM" in message
    for name in ADAPTERS:
        assert name in message


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(do_layer_norm_before=False, word_embed_proj_dim=16), "do_layer_norm_before=False"),  # OPT-350m
        (dict(word_embed_proj_dim=16), "project_out"),
        (dict(_remove_final_layer_norm=True), "final layer norm"),
    ],
    ids=["post_ln", "project_out", "no_final_norm"],
)
def test_opt_variants_without_the_decomposition_are_refused(overrides, reason):
    config = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        ffn_dim=D_FF,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        max_position_embeddings=32,
        **TOKENS,
        **overrides,
    )
    with pytest.raises(UnsupportedArchitecture, match=reason):
        adapter_for(OPTForCausalLM(config))
