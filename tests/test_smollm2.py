"""The real embedded SmolLM2-135M: it predicts " Paris", its cache is reused, its live answers equal a hand
computation. (What an index of it stores is checked against a recomputation in tests/test_cold_start.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from ffmem.config import get_settings
from ffmem.engine.live.trace import trace
from ffmem.engine.model import loading
from ffmem.engine.model.gguf_cache import dequantized_folder
from ffmem.engine.model.known import embedded_gguf
from ffmem.engine.model.loading import load_model

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", device="cpu", cache_dir=get_settings().cache_dir)


def test_predicts_paris(smollm2):
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = smollm2.model(ids).logits[0, -1]  # [vocab]
    assert smollm2.tokenizer.decode(logits.argmax()) == " Paris"
    assert (smollm2.n_layers, smollm2.n_keys, smollm2.adapter.family) == (30, 1536, "llama")


def test_live_trace_predicts_paris_and_refines_it_layer_by_layer(smollm2):
    result = trace(smollm2, smollm2.tokenizer("The capital of France is").input_ids)
    assert smollm2.tokenizer.decode([result.prediction]) == " Paris"
    assert result.layers[-1].top_o == result.prediction  # the last layer's output is the prediction
    assert len(result.layers) == 30 and all(len(layer.memories) == 10 for layer in result.layers)
    # The residual grows more confident in the final token with depth (the paper's Fig. 10).
    assert result.layers[-1].final_prob > result.layers[0].final_prob
    assert result.layers[-1].final_rank < result.layers[0].final_rank


def test_the_dequantized_cache_is_reused(smollm2, monkeypatch):
    gguf = embedded_gguf("smollm2-135m")
    folder, sha = dequantized_folder(gguf, get_settings().cache_dir)
    assert json.loads((folder / "ffmem.json").read_text())["sha256"] == sha == smollm2.revision

    def no_dequantizing(*args, **kwargs):
        raise AssertionError("the GGUF was dequantized again")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", no_dequantizing)
    assert dequantized_folder(gguf, get_settings().cache_dir) == (folder, sha)


def test_try_your_own_text_equals_a_hand_computation(smollm2):
    """Issue 15: the live worker's POST /coefficients on the real model equals silu(x·g)·(x·u) computed
    from the weights and the MLP's input (a plain hook, not ffmem's), at every token of a sentence."""
    from ffmem.engine.live.protocol import CoefficientsRequest
    from ffmem.worker.live_executor import Live

    text = "The Eiffel Tower is in Paris, the capital of France."
    ids = smollm2.tokenizer(text).input_ids
    inputs = {}
    blocks = smollm2.model.model.layers
    handles = [
        block.mlp.register_forward_pre_hook(
            lambda module, args, layer=layer: inputs.__setitem__(layer, args[0][0])
        )
        for layer, block in enumerate(blocks)
    ]
    try:
        with torch.inference_mode():
            smollm2.model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    live = Live(device="cpu")
    for layer in (0, 11, 29):
        mlp = blocks[layer].mlp
        with torch.inference_mode():
            x = inputs[layer].float()  # [pos, d]
            gate = x @ mlp.gate_proj.weight.float().T  # [pos, d_ff]
            m = gate * torch.sigmoid(gate) * (x @ mlp.up_proj.weight.float().T)  # [pos, d_ff]
        key = int(m[1:].abs().amax(dim=0).argmax())  # the key that fires hardest past position 0
        request = CoefficientsRequest(model="smollm2-135m", text=text, layer=layer, key=key)
        with smollm2.lock:
            answer = live.coefficients(smollm2, request)
        assert answer.token_ids == ids
        expected = m[:, key].tolist()
        assert answer.coefficients == pytest.approx(expected, rel=1e-3, abs=1e-3)
        assert answer.max_position == int(m[:, key].argmax()) and answer.min_position == int(
            m[:, key].argmin()
        )
