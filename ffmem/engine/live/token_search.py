"""A token search past the stored depth: over every memory of every layer, the (memory, token) pairs whose
value promotes (the highest score) or suppresses (the lowest) the given tokens most — the ranking of a run's
token → memories table (ffmem.engine.values.token_memories) to any depth, for a few tokens at a time.

The score is the token's logit in the value's readout (raw: v·e_t; norm: lm_head(final_norm(v))_t) or its
log-probability, the logit less the value's log Z over the whole vocabulary. The logits are one product of
the tokens' output-embedding rows with every value, [memories, d] × [d, tokens]; the log Zs need every
value's whole readout, so they are computed once per model and readout (`value_log_z`, the projection's own
chunks: the same numbers as the stored table's) and kept by the caller. Equal scores rank by memory
(layer-major, layer · keys + key), then token, as the stored table and its search do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ffmem.engine.model.adapters.base import resolve
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.values.projection import layer_logits, readout_input

CHUNK = 4096  # values a product at a time: [chunk, d] read out at once


def token_logits(loaded: LoadedModel, token_ids: Sequence[int], readout: str) -> torch.Tensor:
    """Each token's logit in every value's readout: [memories, tokens] float32 on the model's device,
    memories layer-major."""
    unembedding = resolve(loaded.model, loaded.adapter.unembedding)
    rows = torch.as_tensor(list(token_ids), dtype=torch.long, device=unembedding.weight.device)  # [tokens]
    embedding = unembedding.weight[rows]  # [tokens, d]
    bias = getattr(unembedding, "bias", None)
    shift = bias[rows] if readout == "norm" and bias is not None else None  # [tokens]: lm_head's own bias
    parts = []
    with torch.inference_mode():
        for block in loaded.adapter.blocks(loaded.model):
            values = loaded.adapter.value_matrix(block)  # [keys, d]
            for start in range(0, values.shape[0], CHUNK):
                read = readout_input(loaded, values[start : start + CHUNK], readout)  # [chunk, d]
                logits = read @ embedding.T  # [chunk, tokens]
                parts.append((logits if shift is None else logits + shift).float())
    return torch.cat(parts)  # [memories, tokens]


def value_log_z(loaded: LoadedModel, readout: str) -> torch.Tensor:
    """Every value's log-sum-exp over its whole readout, [memories] float32 on the model's device: the
    projection's chunks and arithmetic (ffmem.engine.values.projection.project_layer), so its numbers."""
    parts = [
        logits.logsumexp(dim=-1)  # [chunk]
        for layer in range(loaded.n_layers)
        for _, logits in layer_logits(loaded, layer, readout)
    ]
    return torch.cat(parts)  # [memories]


def strongest(scores: torch.Tensor, direction: int, limit: int) -> list[tuple[int, int, float]]:
    """(memory, token index, score) of the `limit` highest (direction +1) or lowest (−1) of scores
    [memories, tokens], best first, equal scores by memory, then token."""
    flat = direction * scores.reshape(-1)  # [memories · tokens], memory-major
    k = min(limit, flat.numel())
    if k == 0:
        return []
    floor = flat.topk(k).values[-1]  # the k-th best: every pair at least as good is a candidate
    candidates = (flat >= floor).nonzero()[:, 0]  # [candidates], by memory, then token
    order = torch.sort(flat[candidates], descending=True, stable=True).indices[:k]  # ties keep that order
    chosen = candidates[order].tolist()
    tokens = scores.shape[1]
    return [(i // tokens, i % tokens, direction * float(flat[i])) for i in chosen]


def token_search(
    loaded: LoadedModel,
    token_ids: Sequence[int],
    *,
    readout: str,
    by: str,
    limit: int,
    log_z: torch.Tensor | None = None,
) -> dict[int, list[tuple[int, int, float]]]:
    """direction (+1 promote, −1 suppress) → (memory, token id, score) of the `limit` strongest pairs;
    `by="prob"` needs every value's log Z under `readout` (`value_log_z`), which the caller keeps."""
    logits = token_logits(loaded, token_ids, readout)  # [memories, tokens]
    if by == "prob":
        if log_z is None:
            raise ValueError("ranking by probability needs the values' log Z (value_log_z)")
        scores = logits - log_z.to(logits.device)[:, None]  # [memories, tokens]: log p
    elif by == "logit":
        scores = logits
    else:
        raise ValueError(f"unknown ranking {by!r}; choose logit or prob")
    ids = list(token_ids)
    return {
        direction: [(m, ids[t], s) for m, t, s in strongest(scores, direction, limit)]
        for direction in (1, -1)
    }
