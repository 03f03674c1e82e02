"""Loading: local folders, device and dtype choices, clear errors."""

from __future__ import annotations

import pytest
import torch

from ffmem.engine.loading import ModelLoadError, load_model, resolve_dtype, slugify


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
