"""Tiny random models saved as real Hugging Face folders (config, safetensors, fast tokenizer): no hub.

Shared by every test folder through tests/conftest.py.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.model.loading import load_model

TRAINING_TEXT = [
    "The capital of France is Paris.",
    "Paris is a city on the Seine, famous for its museums.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The quick brown fox jumps over the lazy dog.",
    "In 1969, astronauts landed on the Moon for the first time.",
    "Mozart wrote more than six hundred works of music.",
]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few sentences: real offsets, real multi-byte handling."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 5, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


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
