"""Loading: local folders, device and dtype choices, clear errors; one model per process, loaded
one at a time; the checks after every load (missing and left-over weights, checksums, known answer)."""

from __future__ import annotations

import copy
import gc
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file, save_model
from transformers import LlamaConfig, LlamaForCausalLM

from bench.tiny_tokenizer import tiny_tokenizer
from ffmem.engine.model import loading
from ffmem.engine.model.checks import check_answer
from ffmem.engine.model.checksums import combined_checksum, tensor_checksums, weights_sha256
from ffmem.engine.model.loaded import LoadedModel, ModelLoadError, resolve_dtype
from ffmem.engine.model.loading import load_model, shared_model
from ffmem.engine.model.model_names import slugify


def test_local_folder_loads_with_its_adapter(tiny, tiny_model_dir):
    assert tiny.adapter.family == "llama"
    assert (tiny.n_layers, tiny.n_keys) == (3, 48)
    assert tiny.slug == slugify(str(tiny_model_dir))
    assert tiny.device == torch.device("cpu") and tiny.dtype == torch.float32
    assert not tiny.bos_prepended


def test_bfloat16_on_cpu_when_asked(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


def test_auto_dtype_is_float32_on_cpu():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(ModelLoadError, match="unknown dtype 'int3'"):
        resolve_dtype("int3", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_says_so():
    with pytest.raises(ModelLoadError, match="torch sees no GPU; use --device cpu"):
        load_model("smollm2-135m", device="cuda")


def test_unreachable_hub_id_says_how_to_pass_a_local_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache: nothing to find offline
    with pytest.raises(ModelLoadError, match=r"pass a local folder .*--model /path/to/folder"):
        load_model("no-such-org/no-such-model", device="cpu", cache_dir=tmp_path)


def test_folder_without_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="is not a Hugging Face model folder"):
        load_model(str(tmp_path), device="cpu", cache_dir=tmp_path)


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no GGUF file"):
        load_model(str(tmp_path / "model.gguf"), device="cpu", cache_dir=tmp_path)


def test_slugs():
    assert slugify("EleutherAI/pythia-70m") == "eleutherai-pythia-70m"
    assert slugify("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct.q4-1"


# -- one model per process, loaded once ---------------------------------------------------------------
def _tied_tiny(folder: Path, *, lm_head_only: bool = False) -> Path:
    """A 2-layer Llama whose output embedding is tied to its input embedding, saved as transformers
    saves it (the tied tensor once, as model.embed_tokens.weight) or, with `lm_head_only`, as
    ffmem's old cache did (safetensors' save_model kept lm_head.weight only)."""
    torch.manual_seed(1)
    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if lm_head_only:
        save_model(model, str(folder / "model.safetensors"))
        assert "lm_head.weight" in safe_open(folder / "model.safetensors", "pt").keys()
    return folder


def _rewrite_weights(folder: Path, change) -> None:
    """Rewrite folder/model.safetensors with change(tensors) applied (its metadata kept)."""
    path = folder / "model.safetensors"
    with safe_open(path, "pt") as file:
        metadata = file.metadata()
        tensors = {name: file.get_tensor(name) for name in file.keys()}
    change(tensors)
    save_file(tensors, str(path), metadata=metadata)


def _copy(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to)
    return to


def test_threads_loading_at_once_all_get_the_checkpoint(tmp_path):
    """transformers' from_pretrained swaps PreTrainedModel.tie_weights for a no-op while it loads; two
    threads loading at once could restore the no-op for good, and every later load in the process left
    the embedding random. Loading is serialized: every thread gets the checkpoint's weights."""
    folder = _tied_tiny(tmp_path / "tied", lm_head_only=True)
    expected = safe_open(folder / "model.safetensors", "pt").get_tensor("lm_head.weight")  # [vocab, d]
    results: list = [None] * 6
    start = threading.Barrier(len(results))

    def load(index: int) -> None:
        start.wait()
        try:
            results[index] = load_model(str(folder), device="cpu", dtype="float32")
        except Exception as error:  # noqa: BLE001 - reported below
            results[index] = error

    threads = [threading.Thread(target=load, args=(index,)) for index in range(len(results))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for loaded in results:
        assert isinstance(loaded, LoadedModel), loaded
        assert torch.equal(loaded.model.model.embed_tokens.weight, expected)
        assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert len({loaded.weights_sha256 for loaded in results}) == 1
    assert load_model(str(folder), device="cpu").weights_sha256 == results[0].weights_sha256  # still right


def test_shared_model_is_loaded_once_for_every_thread(tiny_model_dir, monkeypatch):
    loads = []
    real_load = loading._load

    def counted(*args, **kwargs):
        loads.append(args[0])
        time.sleep(0.2)  # the others arrive while it loads
        return real_load(*args, **kwargs)

    monkeypatch.setattr(loading, "_load", counted)
    source = str(tiny_model_dir)
    results: list = [None] * 5
    start = threading.Barrier(len(results))

    def take(index: int) -> None:
        start.wait()
        results[index] = shared_model(source, device="cpu", dtype="float32")

    threads = [threading.Thread(target=take, args=(index,)) for index in range(len(results))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(loaded is results[0] for loaded in results)
    assert loads == [source]
    assert shared_model(source, device="cpu", dtype="auto") is results[0]  # auto is float32 on CPU
    other = shared_model(source, device="cpu", dtype="bfloat16")  # another dtype is another model
    assert other is not results[0] and other.dtype == torch.bfloat16
    assert loads == [source, source]


def test_shared_model_is_let_go_when_no_one_holds_it(tiny_model_dir, monkeypatch):
    loads = []
    real_load = loading._load
    monkeypatch.setattr(loading, "_load", lambda *args: loads.append(args[0]) or real_load(*args))
    source = str(tiny_model_dir)
    held = shared_model(source, device="cpu", dtype="float16")
    assert shared_model(source, device="cpu", dtype="float16") is held and len(loads) == 1
    del held
    gc.collect()
    shared_model(source, device="cpu", dtype="float16")
    assert len(loads) == 2  # nothing kept it: the process did not hold on to a model nobody uses


# -- integrity checks after every load -------------------------------------------------------------------
def test_a_weight_missing_from_the_checkpoint_is_an_error_that_names_it(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, tmp_path / "broken")
    _rewrite_weights(folder, lambda tensors: tensors.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(
        ModelLoadError, match=r"1 weights missing .*: model\.layers\.1\.mlp\.down_proj\.weight"
    ):
        load_model(str(folder), device="cpu")


def test_a_weight_the_model_has_no_place_for_is_an_error_that_names_it(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, tmp_path / "extra")
    _rewrite_weights(
        folder, lambda tensors: tensors.update({"model.layers.7.mlp.up_proj.weight": torch.ones(2)})
    )
    with pytest.raises(ModelLoadError, match=r"has no place for: model\.layers\.7\.mlp\.up_proj\.weight"):
        load_model(str(folder), device="cpu")


def test_tied_weights_saved_once_load_cleanly_but_not_when_both_are_gone(tmp_path):
    folder = _tied_tiny(tmp_path / "tied")
    assert "lm_head.weight" not in safe_open(folder / "model.safetensors", "pt").keys()
    loaded = load_model(str(folder), device="cpu")  # lm_head.weight is tied, not missing
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    _rewrite_weights(folder, lambda tensors: tensors.pop("model.embed_tokens.weight"))
    with pytest.raises(ModelLoadError, match=r"missing .*model\.embed_tokens\.weight"):
        load_model(str(folder), device="cpu")


def test_the_known_answer_check(tiny):
    ids = tiny.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        greedy = tiny.tokenizer.decode([int(tiny.model(ids).logits[0, -1].argmax())])
    check_answer(tiny, "The capital of France is", greedy)
    assert greedy != " Paris"  # a random model does not know it
    wrong = rf"answers {re.escape(repr(greedy))} after 'The capital of France is' instead of ' Paris'"
    with pytest.raises(ModelLoadError, match=wrong):
        check_answer(tiny, "The capital of France is", " Paris")


def test_the_weights_checksum(tiny, tiny_model_dir):
    assert tiny.weights_sha256 == weights_sha256(tiny.model)
    assert load_model(str(tiny_model_dir), device="cpu").weights_sha256 == tiny.weights_sha256
    half = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    assert half.weights_sha256 == weights_sha256(half.model) != tiny.weights_sha256
    checksums = tensor_checksums(tiny.model)
    assert (
        set(checksums) == set(tiny.model.state_dict()) and combined_checksum(checksums) == tiny.weights_sha256
    )
    changed = copy.deepcopy(tiny.model)
    with torch.no_grad():
        changed.model.layers[2].mlp.down_proj.weight[5, 7] += 1e-3
    after = tensor_checksums(changed)
    assert [name for name in checksums if checksums[name] != after[name]] == [
        "model.layers.2.mlp.down_proj.weight"
    ]
    assert weights_sha256(changed) != tiny.weights_sha256
