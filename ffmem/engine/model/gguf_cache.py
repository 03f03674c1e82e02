"""The GGUF cache: a GGUF dequantized once into safetensors under the cache folder (keyed by the file's
sha256), written under a file lock that holds across processes, checksummed tensor by tensor."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf as gguf_py
import torch
import transformers
from filelock import FileLock, Timeout
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from ffmem.engine.model.checks import check_loading_info
from ffmem.engine.model.checksums import combined_checksum, sha256_file, tensor_checksums
from ffmem.engine.model.loaded import ModelLoadError
from ffmem.engine.model.model_names import slugify

CACHE_FORMAT = 2  # ffmem.json "format": 2 = save_pretrained (tied weights once) + per-tensor checksums
CACHE_LOCK_SECONDS = 900.0  # how long a process waits for another one writing the same cache folder


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
    with _parsed_once():
        model, info = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            quantization_config=GgufConfig(dequantize=True),  # plain float32 Linear layers, never GGUF blocks
            dtype=torch.float32,
            output_loading_info=True,
        )
        check_loading_info(str(gguf), model, info, remedy="is the GGUF file complete?")
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


_PARSING = threading.Lock()  # one dequantization at a time swaps gguf's functions


@contextmanager
def _parsed_once() -> Iterator[None]:
    """Within the block, gguf parses a file once and builds a tensor name map once: transformers reads the
    GGUF anew for its config, its weights and its tokenizer (three `GGUFReader`s, each parsing every
    metadata field: the vocabulary and merges are ~440K of them at SmolLM2) and builds gguf's
    `TensorNameMap` once per submodule (~400 at SmolLM2), together ~60% of a cold load's CPU time. Both are
    read-only once built, so each is kept by its arguments and given again."""
    with _PARSING:
        reader, name_map = gguf_py.GGUFReader, gguf_py.get_tensor_name_map
        readers: dict = {}

        def parsed(path, mode="r"):
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = reader(path, mode)
            return readers[key]

        gguf_py.GGUFReader, gguf_py.get_tensor_name_map = parsed, functools.cache(name_map)
        try:
            yield
        finally:
            gguf_py.GGUFReader, gguf_py.get_tensor_name_map = reader, name_map
