"""bench/shapes.py: a random-weight model of a named shape, written as a Hugging Face folder, has that
shape, its random weights and the default model's tokenizer; `ffmem index` builds a whole run of it, its
vocabulary padded past the tokenizer with `⟨unused N⟩` entries.

The weights are read back with safetensors alone (not through ffmem.engine) and counted by hand.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import func, select
from transformers import AutoTokenizer
from typer.testing import CliRunner

from bench.shapes import SHAPES, default_tokenizer, write_shape
from ffmem.cli import cli
from ffmem.config import get_settings
from ffmem.store import memory_reads, vocabularies
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import KeyStats, LanguageModel, Run, Token

TOKENIZER_IDS = 49152  # the default model's tokenizer, every shape's


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory) -> Path:
    """The default model's tokenizer, read from its GGUF once and saved (as `bench/shapes.py tokenizer`)."""
    folder = tmp_path_factory.mktemp("tokenizer")
    default_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, base_tokenizer) -> Path:
    """The tiny shape in bf16, split into shards of at most 5 MB."""
    folder = tmp_path_factory.mktemp("tiny")
    return write_shape("tiny", folder, "bfloat16", tokenizer=base_tokenizer, max_shard_size="5MB")


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files (one file or the shards its index lists)."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else []
    tensors = {}
    for name in files or ["model.safetensors"]:
        tensors |= load_file(folder / name)
    return tensors


def expected_shapes(shape) -> dict[str, tuple[int, ...]]:
    """The tensors a Llama of `shape` has, by name, written out from its architecture."""
    head_dim = shape.hidden // shape.heads
    out = {"model.embed_tokens.weight": (shape.vocab, shape.hidden), "model.norm.weight": (shape.hidden,)}
    if not shape.tied:
        out["lm_head.weight"] = (shape.vocab, shape.hidden)
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}."
        out |= {
            prefix + "self_attn.q_proj.weight": (shape.heads * head_dim, shape.hidden),
            prefix + "self_attn.k_proj.weight": (shape.kv_heads * head_dim, shape.hidden),
            prefix + "self_attn.v_proj.weight": (shape.kv_heads * head_dim, shape.hidden),
            prefix + "self_attn.o_proj.weight": (shape.hidden, shape.heads * head_dim),
            prefix + "mlp.gate_proj.weight": (shape.intermediate, shape.hidden),
            prefix + "mlp.up_proj.weight": (shape.intermediate, shape.hidden),
            prefix + "mlp.down_proj.weight": (shape.hidden, shape.intermediate),
            prefix + "input_layernorm.weight": (shape.hidden,),
            prefix + "post_attention_layernorm.weight": (shape.hidden,),
        }
    return out


def test_the_named_shapes_have_the_real_models_parameter_counts():
    counts = {name: SHAPES[name].parameters() for name in ("smollm2-135m", "llama-3.2-1b", "llama-3.1-8b")}
    assert counts == {
        "smollm2-135m": 134_515_008,
        "llama-3.2-1b": 1_235_814_400,
        "llama-3.1-8b": 8_030_261_248,
    }
    assert SHAPES["llama-3.1-8b"].memories == 458_752


def test_the_qwen3_32b_shape_is_its_memories_vocabulary_and_weights_less_the_qk_norms():
    shape = SHAPES["qwen3-32b"]
    assert (shape.layers, shape.intermediate, shape.memories, shape.vocab) == (64, 25_600, 1_638_400, 151_936)
    # Qwen/Qwen3-32B's config: 64 heads of 128 (wider than hidden / heads), 8 key-value heads, untied.
    attention = 5120 * 128 * (2 * 64 + 2 * 8)
    block = attention + 3 * 5120 * 25_600 + 2 * 5120
    assert shape.parameters() == 151_936 * 5120 * 2 + 64 * block + 5120
    assert shape.parameters() == pytest.approx(32.8e9, rel=0.002)  # the model card's 32.8B


def test_a_written_shape_has_its_tensors_random_weights_and_shards(tiny_folder):
    shape = SHAPES["tiny"]
    tensors = weights(tiny_folder)
    assert (tiny_folder / "model.safetensors.index.json").exists()  # 13 MB in shards of ≤ 5 MB
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected_shapes(shape)
    assert sum(t.numel() for t in tensors.values()) == shape.parameters()
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    config = json.loads((tiny_folder / "config.json").read_text())
    written = (config["vocab_size"], config["intermediate_size"], config["tie_word_embeddings"])
    assert written == (49408, 192, False)
    assert len(AutoTokenizer.from_pretrained(tiny_folder)) == TOKENIZER_IDS  # the padding has no tokens
    for name, tensor in tensors.items():
        values = tensor.float()
        if name.endswith("norm.weight"):
            assert bool((values == 1).all()), name
        else:
            assert abs(float(values.std()) - 0.02) < 0.002, name  # normal(0, initializer_range)
            assert abs(float(values.mean())) < 0.002, name
    gate, up = tensors["model.layers.0.mlp.gate_proj.weight"], tensors["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(gate, up)  # each tensor drawn from its own seed
    assert not torch.equal(tensors["model.embed_tokens.weight"], tensors["lm_head.weight"])


def test_a_tied_shape_stores_its_embedding_once(tmp_path, base_tokenizer, monkeypatch):
    monkeypatch.setitem(SHAPES, "tiny-tied", dataclasses.replace(SHAPES["tiny"], tied=True))
    folder = write_shape("tiny-tied", tmp_path / "tied", "float32", tokenizer=base_tokenizer, seed=1)
    tensors = weights(folder)
    assert "lm_head.weight" not in tensors and tensors["model.embed_tokens.weight"].dtype == torch.float32
    assert sum(t.numel() for t in tensors.values()) == SHAPES["tiny-tied"].parameters()
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True


def test_the_same_seed_writes_the_same_weights(tmp_path, base_tokenizer, tiny_folder):
    again = write_shape("tiny", tmp_path / "again", "bfloat16", tokenizer=base_tokenizer)
    first, second = weights(tiny_folder), weights(again)
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_ffmem_index_builds_a_run_of_a_written_shape(tmp_path, tiny_folder, monkeypatch):
    monkeypatch.setenv("FFMEM_CACHE_DIR", str(tmp_path / "cache"))
    # The explanations' scores and TokenChange on 20 of the source's unread sentences, not the default 1,000
    # (a forward pass over each), and TokenChange for 2 memories a layer, not all 576 (each one's output score
    # ranks the 49,408-token vocabulary): most of this test's time; both are checked on the tiny index
    monkeypatch.setenv("FFMEM_EXPLAIN_SENTENCES", "20")
    monkeypatch.setenv("FFMEM_TOKEN_CHANGE_MEMORIES", "6")
    get_settings.cache_clear()
    url = f"sqlite:///{tmp_path / 'index.db'}"
    arguments = ["index", "--model", str(tiny_folder), "--sentences", "12", "--db", url, "--device", "cpu"]
    result = CliRunner().invoke(cli, arguments)
    get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    shape = SHAPES["tiny"]
    with make_sessionmaker(make_engine(url))() as session:
        run = session.scalars(select(Run)).one()
        model = session.get(LanguageModel, run.model_id)
        assert (run.status, run.dtype, model.n_layers, model.n_keys) == ("done", "float32", 3, 192)
        keys = select(KeyStats.layer, func.count()).where(KeyStats.run_id == run.id).group_by(KeyStats.layer)
        assert dict(session.execute(keys).all()) == {
            layer: shape.intermediate for layer in range(shape.layers)
        }
        assert model.vocab_size == shape.vocab
        assert session.scalar(select(func.count()).where(Token.model_id == model.id)) == shape.vocab
        texts = vocabularies.vocabulary(session=session, model_id=model.id)
        assert len(texts) == shape.vocab
        padding = {i: texts[i] for i in range(TOKENIZER_IDS, shape.vocab)}
        assert padding == {i: f"⟨unused {i}⟩" for i in range(TOKENIZER_IDS, shape.vocab)}
        assert not texts[TOKENIZER_IDS - 1].startswith("⟨unused")  # the tokenizer's last token
        # Value tokens reach past the tokenizer's ids (random values promote any of the 49,408), each
        # read as its padding entry.
        past = {v.token_id for v in memory_reads.iter_value_tokens(session=session, run_id=run.id)} - set(
            range(TOKENIZER_IDS)
        )
        assert past
        read = vocabularies.token_texts(session=session, model_id=model.id, token_ids=past)
        assert read == {i: f"⟨unused {i}⟩" for i in past}
