"""Checksums of a model's weights: of a file, of every tensor (its dtype, shape and bytes), of them all."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
