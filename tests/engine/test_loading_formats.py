"""Loading the checkpoints researchers have: sharded safetensors folders, bf16 checkpoints, read straight
into the target dtype; and a model that will not fit the device's memory refused before it is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from ffmem.engine.model import fit, loading
from ffmem.engine.model.fit import check_fits, free_memory, parameter_count
from ffmem.engine.model.loaded import ModelLoadError
from ffmem.engine.model.loading import load_model

PROMPT = "The capital of France is"
INDEX = "model.safetensors.index.json"


def _file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files (one file or shards), as saved."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as file:
            tensors.update({name: file.get_tensor(name) for name in file.keys()})
    return tensors


def _resave(tiny_model_dir: Path, folder: Path, **save) -> Path:
    """The tiny Llama saved again into `folder` (save_pretrained's keyword arguments), with its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.save_pretrained(folder, **save)
    _copy_tokenizer(tiny_model_dir, folder)
    return folder


def _copy_tokenizer(source: Path, folder: Path) -> None:
    for path in source.iterdir():
        if path.name.startswith("tokenizer") or path.name == "special_tokens_map.json":
            shutil.copy(path, folder / path.name)


def _logits(loaded) -> torch.Tensor:
    ids = loaded.tokenizer(PROMPT, return_tensors="pt").input_ids  # [1, pos]
    with torch.inference_mode():
        return loaded.model(ids).logits[0]  # [pos, vocab]


# -- sharded safetensors ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharded_dir(tiny_model_dir, tmp_path_factory) -> Path:
    folder = _resave(tiny_model_dir, tmp_path_factory.mktemp("sharded"), max_shard_size="50KB")
    assert (folder / INDEX).is_file() and not (folder / "model.safetensors").exists()
    assert len(list(folder.glob("model-*-of-*.safetensors"))) >= 3
    return folder


def _rewrite_shards(folder: Path, change) -> None:
    """Apply change(tensors, shard_of) to the sharded folder: every shard and the index are rewritten
    from what it leaves (`shard_of` maps a name to its shard file; a new name needs an entry)."""
    index = json.loads((folder / INDEX).read_text())
    shard_of = dict(index["weight_map"])
    tensors = _file_tensors(folder)
    change(tensors, shard_of)
    for path in folder.glob("model-*-of-*.safetensors"):
        save_file(
            {name: tensor for name, tensor in tensors.items() if shard_of[name] == path.name},
            str(path),
            metadata={"format": "pt"},
        )
    index["weight_map"] = {name: shard_of[name] for name in sorted(tensors)}
    (folder / INDEX).write_text(json.dumps(index, indent=2))


def test_a_sharded_folder_loads_the_unsharded_weights(tiny, sharded_dir):
    loaded = load_model(str(sharded_dir), device="cpu", dtype="float32")
    whole, shards = tiny.model.state_dict(), loaded.model.state_dict()
    assert shards.keys() == whole.keys()
    for name, tensor in whole.items():
        assert torch.equal(shards[name], tensor), name
    assert loaded.weights_sha256 == tiny.weights_sha256
    assert torch.equal(_logits(loaded), _logits(tiny))


def test_a_weight_missing_from_a_shard_is_named(sharded_dir, tmp_path):
    folder = Path(shutil.copytree(sharded_dir, tmp_path / "sharded"))
    _rewrite_shards(folder, lambda tensors, shard_of: tensors.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"1 weights missing .*: model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(str(folder), device="cpu")


def test_a_weight_in_a_shard_the_model_has_no_place_for_is_named(sharded_dir, tmp_path):
    folder = Path(shutil.copytree(sharded_dir, tmp_path / "sharded"))

    def add(tensors, shard_of):
        tensors["model.layers.9.mlp.up_proj.weight"] = torch.ones(2)
        shard_of["model.layers.9.mlp.up_proj.weight"] = shard_of["lm_head.weight"]

    _rewrite_shards(folder, add)
    with pytest.raises(ModelLoadError, match=r"has no place for: model\.layers\.9\.mlp\.up_proj\.weight"):
        load_model(str(folder), device="cpu")


def test_a_missing_shard_file_is_a_clear_error(sharded_dir, tmp_path):
    folder = Path(shutil.copytree(sharded_dir, tmp_path / "sharded"))
    lost = sorted(folder.glob("model-*-of-*.safetensors"))[1]
    lost.unlink()
    with pytest.raises(
        ModelLoadError, match=rf"{folder.name} could not be read .*{lost.name}.*all the shards"
    ):
        load_model(str(folder), device="cpu")


# -- bf16 checkpoints ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_dir(tiny_model_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bf16")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    _copy_tokenizer(tiny_model_dir, folder)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert {tensor.dtype for tensor in _file_tensors(folder).values()} == {torch.bfloat16}
    return folder


def test_a_bf16_checkpoint_loads_as_float32_on_a_cpu_upcast_exactly(bf16_dir):
    saved = _file_tensors(bf16_dir)  # bfloat16
    loaded = load_model(str(bf16_dir), device="cpu", dtype="auto")
    assert loaded.dtype == torch.float32
    state = loaded.model.state_dict()
    assert state.keys() == saved.keys()
    for name, tensor in saved.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], tensor.float()), name


def test_a_bf16_checkpoint_asked_in_bf16_keeps_its_bits(bf16_dir):
    saved = _file_tensors(bf16_dir)
    loaded = load_model(str(bf16_dir), device="cpu", dtype="bfloat16")
    state = loaded.model.state_dict()
    for name, tensor in saved.items():
        assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], tensor), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_weights_are_read_straight_into_the_target_dtype(tiny_model_dir, monkeypatch, dtype):
    """No float32 copy first: transformers is asked for the target dtype (never "auto"), and what it
    hands back already is in it; the move to the device is the only step after."""
    real = loading.AutoModelForCausalLM.from_pretrained
    read = []

    def spy(*args, **kwargs):
        model, info = real(*args, **kwargs)
        read.append((kwargs["dtype"], {parameter.dtype for parameter in model.parameters()}))
        return model, info

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", spy)
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype=dtype)
    target = getattr(torch, dtype)
    assert read == [(target, {target})] and loaded.dtype == target


# -- will it fit ----------------------------------------------------------------------------------------
LLAMA_8B = LlamaConfig(  # Llama-3.1-8B's shape
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)


def test_the_parameter_count_comes_from_the_config_alone(tiny, tiny_model_dir, tmp_path):
    assert parameter_count(str(tiny_model_dir)) == sum(p.numel() for p in tiny.model.parameters())
    LLAMA_8B.save_pretrained(tmp_path)  # a config and no weights
    assert parameter_count(str(tmp_path)) == 8_030_261_248
    assert parameter_count(str(tmp_path / "nothing")) is None  # the load says why


def test_free_memory_of_the_cpu_is_read():
    assert free_memory(torch.device("cpu")) > 0
    assert free_memory(torch.device("meta")) is None  # unknown: the check passes


def test_a_model_that_does_not_fit_the_ram_is_refused_with_the_numbers(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(loading, "parameter_count", lambda target: 8_030_261_248)
    monkeypatch.setattr(fit, "free_memory", lambda device: 9_800_000_000)
    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", pytest.fail)  # refused before
    source = str(tiny_model_dir)
    with pytest.raises(ModelLoadError) as error:
        load_model(source, device="cpu", dtype="bfloat16")
    assert str(error.value) == (
        f"{source} needs ~16.1 GB in bfloat16; this machine has 9.8 GB of RAM free. "
        "Use a smaller model or a larger device."
    )
    with pytest.raises(ModelLoadError) as error:
        load_model(source, device="cpu", dtype="float32")
    assert str(error.value) == (
        f"{source} needs ~32.1 GB in float32; this machine has 9.8 GB of RAM free. "
        "Use a smaller model, --dtype bfloat16 or float16 (half the memory), or a larger device."
    )


def test_a_model_that_does_not_fit_the_gpu_is_refused_with_the_numbers(monkeypatch):
    free = {"cuda": 9_800_000_000, "cpu": 100_000_000_000}
    monkeypatch.setattr(fit, "free_memory", lambda device: free[device.type])
    gpu = torch.device("cuda", 0)
    with pytest.raises(ModelLoadError) as error:
        check_fits("meta-llama/Llama-3.1-8B", 8_030_261_248, gpu, torch.bfloat16, torch.bfloat16)
    assert str(error.value) == (
        "meta-llama/Llama-3.1-8B needs ~16.1 GB in bfloat16; the GPU (cuda:0) has 9.8 GB free. "
        "Use a smaller model or a larger device."
    )
    free["cuda"] = 17_000_000_000
    check_fits("meta-llama/Llama-3.1-8B", 8_030_261_248, gpu, torch.bfloat16, torch.bfloat16)  # fits
    free["cpu"] = 20_000_000_000  # the host reads a GGUF's float32 cache before the cast and the move
    with pytest.raises(ModelLoadError) as error:
        check_fits("model.gguf", 8_030_261_248, gpu, torch.bfloat16, torch.float32)
    assert str(error.value) == (
        "model.gguf needs ~32.1 GB in float32 while it loads (read in float32, then cast to bfloat16, "
        "before the move to cuda:0); this machine has 20.0 GB of RAM free. Use a smaller model or a "
        "larger device."
    )


def test_a_model_that_fits_loads(tiny, tiny_model_dir, monkeypatch):
    needed = sum(p.numel() for p in tiny.model.parameters()) * 4  # float32
    monkeypatch.setattr(fit, "free_memory", lambda device: needed)
    assert load_model(str(tiny_model_dir), device="cpu").weights_sha256 == tiny.weights_sha256
    monkeypatch.setattr(fit, "free_memory", lambda device: needed - 1)
    with pytest.raises(ModelLoadError, match=r"needs ~0\.\d MB in float32; this machine has 0\.\d MB"):
        load_model(str(tiny_model_dir), device="cpu")
