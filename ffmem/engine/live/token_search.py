"""A token search past the stored depth: over every memory of every layer, the (memory, token) pairs whose
value promotes (the highest score) or suppresses (the lowest) the given tokens most — the ranking of a run's
token → memories table (ffmem.engine.values.token_memories) to any depth, for a few tokens at a time.

The score is the token's logit in the value's readout (raw: v·e_t; norm: lm_head(final_norm(v))_t) or its
log-probability, the logit less the value's log Z over the whole vocabulary. Either logit is one product of
the tokens' output-embedding rows with every value, [tokens, d] × [d, memories]: the final norm splits as
final_norm(v) = w⊙(v − μ)·s + b (ffmem.engine.values.projection.norm_parts; RMSNorm: μ = 0, b = 0), so
v's norm logit of t is s·(v·(w⊙e_t) − μ·Σ(w⊙e_t)) + b·e_t (+ lm_head's bias), with each value's s and μ
(`value_scales`) computed once per model. The log Zs need every value's whole readout: computed once per
model and readout too (`value_log_z`, the projection's own chunks: the numbers the stored table has). The
caller keeps both. Equal scores rank by memory (layer-major, layer · keys + key), then token, as the stored
table and its search do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ffmem.engine.model.adapters.base import resolve
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.values.projection import layer_logits, norm_parts


@dataclass(frozen=True)
class ValueScales:
    """Each value's part of the final norm, final_norm(v) = w⊙(v − μ)·s + b: s and μ, [memories] float32
    (μ None for an RMSNorm, which centres nothing)."""

    scale: torch.Tensor  # [memories]
    mean: torch.Tensor | None  # [memories]


def value_scales(loaded: LoadedModel) -> ValueScales:
    """Every value's s and μ under the model's final norm (one pass over the values)."""
    centred = isinstance(resolve(loaded.model, loaded.adapter.final_norm), torch.nn.LayerNorm)
    scales, means = [], []
    with torch.inference_mode():
        for block in loaded.adapter.blocks(loaded.model):
            values = loaded.adapter.value_matrix(block)  # [keys, d]
            scales.append(norm_parts(loaded, values)[1][:, 0])  # [keys]
            if centred:
                means.append(values.float().mean(dim=-1))  # [keys]
    return ValueScales(torch.cat(scales), torch.cat(means) if centred else None)


def token_logits(
    loaded: LoadedModel, token_ids: Sequence[int], readout: str, scales: ValueScales | None = None
) -> torch.Tensor:
    """Each token's logit in every value's readout: [memories, tokens] float32 on the model's device,
    memories layer-major. `scales`: the norm readout's (`value_scales`), computed here when not given."""
    unembedding = resolve(loaded.model, loaded.adapter.unembedding)
    rows = torch.as_tensor(list(token_ids), dtype=torch.long, device=unembedding.weight.device)  # [tokens]
    with torch.inference_mode():
        embedding = unembedding.weight[rows].float()  # [tokens, d]: e_t
        shift = torch.zeros(len(rows), device=embedding.device)  # [tokens]: added to every value's logit
        if readout == "norm":
            scales = value_scales(loaded) if scales is None else scales
            norm = resolve(loaded.model, loaded.adapter.final_norm)
            if getattr(norm, "bias", None) is not None:
                shift = shift + embedding @ norm.bias.float()  # b·e_t
            if getattr(unembedding, "bias", None) is not None:
                shift = shift + unembedding.bias[rows].float()  # lm_head's own
            embedding = embedding * norm.weight.float()  # [tokens, d]: w⊙e_t
        elif readout != "raw":
            raise ValueError(f"unknown readout {readout!r}; choose raw or norm")
        parts = []
        for block in loaded.adapter.blocks(loaded.model):
            values = loaded.adapter.value_matrix(block)  # [keys, d]
            # E·Vᵀ, not V·Eᵀ: the value matrix is often the transpose of a stored weight (down_proj's
            # [d, keys]), which BLAS reads 10–20× faster this way round on a CPU.
            parts.append((embedding.to(values.dtype) @ values.T).float().T)  # [keys, tokens]
        logits = torch.cat(parts)  # [memories, tokens]
        if readout == "norm":
            if scales.mean is not None:  # (v − μ)·(w⊙e_t) = v·(w⊙e_t) − μ·Σ(w⊙e_t)
                logits = logits - scales.mean.to(logits.device)[:, None] * embedding.sum(dim=-1)
            logits = logits * scales.scale.to(logits.device)[:, None]
        return logits + shift  # [memories, tokens]


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
    scales: ValueScales | None = None,
) -> dict[int, list[tuple[int, int, float]]]:
    """direction (+1 promote, −1 suppress) → (memory, token id, score) of the `limit` strongest pairs;
    `by="prob"` needs every value's log Z under `readout` (`value_log_z`), the norm readout its `scales`
    (`value_scales`; computed here when not given): the caller keeps them."""
    logits = token_logits(loaded, token_ids, readout, scales)  # [memories, tokens]
    if by == "prob":
        if log_z is None:
            raise ValueError("ranking by probability needs the values' log Z (value_log_z)")
        scores = logits - log_z.to(logits.device)[:, None]  # [memories, tokens]: log p
    elif by == "logit":
        scores = logits
    else:
        raise ValueError(f"unknown ranking {by!r}; choose logit or prob")
    ids = list(token_ids)
    found = {direction: strongest(scores, direction, limit) for direction in (1, -1)}
    return {direction: [(m, ids[t], s) for m, t, s in pairs] for direction, pairs in found.items()}
