"""Tiny random models saved as real Hugging Face folders (config, safetensors, fast tokenizer): no hub.

Shared by every test folder through tests/conftest.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.tiny_tokenizer import tiny_tokenizer
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.model.loading import load_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 3-layer gated (SwiGLU) Llama with 48 memories a layer, saved with its tokenizer."""
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))  # default init hides norm/bias mistakes
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny(tiny_model_dir) -> LoadedModel:
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


def scaled_log_p(tiny: LoadedModel, prefix: list[int], layer: int, key: int, scale: float) -> torch.Tensor:
    """log p of the next token after `prefix` with memory (layer, key)'s coefficient scaled by `scale` at the
    prefix's last token, by the tiny Llama's own forward with a plain hook (apart from ffmem.engine):
    [vocab]."""

    def hook(module, inputs):
        m = inputs[0].clone()  # [1, pos, d_ff]
        m[0, -1, key] *= scale
        return (m,)

    handle = tiny.model.model.layers[layer].mlp.down_proj.register_forward_pre_hook(hook)
    try:
        with torch.inference_mode():
            return tiny.model(torch.tensor([prefix])).logits[0, -1].float().log_softmax(-1)  # [vocab]
    finally:
        handle.remove()
