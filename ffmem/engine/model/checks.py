"""The checks of every load: no weight missing or left over, a cached copy as it was written, the known
answer of a known model."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ffmem.engine.model.loaded import LoadedModel, ModelLoadError


def _names(keys, limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def check_loading_info(source: str, model: nn.Module, info: dict, remedy: str) -> None:
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


def check_cache(source: str, folder: Path, manifest: dict, checksums: dict[str, str]) -> None:
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
