"""A loaded model, what the engine passes around (`LoadedModel`), the device and dtype it is loaded on, and
the error every load raises."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from ffmem.engine.errors import FfmemError
from ffmem.engine.model.adapters import Adapter
from ffmem.engine.model.adapters.base import resolve


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
