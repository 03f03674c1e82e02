"""Value vectors → vocabulary: each value's top and bottom tokens under two readouts.

- raw:  v·Eᵀ, the paper's readout (E the output embedding, no bias, no norm).
- norm: lm_head(final_norm(v)), the model's own path from a residual to logits applied to v alone.
Probabilities are a softmax over the full vocabulary. Work is chunked over keys, on the model's
device, so all values of a 30-layer model project in one pass without holding [keys, vocab] for
more than a chunk at a time. The inverse, vocabulary → memories, is ffmem.engine.token_memories.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ffmem.engine.adapters.base import resolve
from ffmem.engine.loading import LoadedModel

READOUTS = ("raw", "norm")


@dataclass
class ValueTokens:
    """Top (direction +1) or bottom (−1) tokens of every value of one layer under one readout."""

    layer: int
    readout: str
    direction: int
    token_ids: torch.Tensor  # [keys, n] int64
    logits: torch.Tensor  # [keys, n]
    probs: torch.Tensor  # [keys, n]
    log_z: torch.Tensor  # [keys]: log-sum-exp of each value's logits (probs = exp(logits − log_z))


def readout_input(loaded: LoadedModel, vectors: torch.Tensor, readout: str) -> torch.Tensor:
    """What the output embedding reads under `readout`: the vectors (raw) or final_norm(vectors):
    [..., d] → [..., d]."""
    if readout == "raw":
        return vectors
    if readout == "norm":
        return resolve(loaded.model, loaded.adapter.final_norm)(vectors)
    raise ValueError(f"unknown readout {readout!r}; choose from {READOUTS}")


def norm_parts(
    loaded: LoadedModel, vectors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The final norm split as final_norm(x) = linear(x)·scale(x) + bias, exactly, for the norms of the
    supported families — LayerNorm: linear = w⊙(x − mean x), scale = 1/√(var x + ε); RMSNorm:
    linear = w⊙x, scale = 1/√(mean x² + ε). The linear part is linear in x, so for o = r + y the
    logits of o follow from those of r and y without another pass over the vocabulary.
    [n, d] → (linear [n, d], scale [n, 1], bias [d] or None), float32."""
    norm = resolve(loaded.model, loaded.adapter.final_norm)
    x = vectors.float()  # [n, d]
    if isinstance(norm, torch.nn.LayerNorm):
        centered = x - x.mean(dim=-1, keepdim=True)  # [n, d]
        scale = torch.rsqrt(centered.pow(2).mean(dim=-1, keepdim=True) + norm.eps)  # [n, 1]
        bias = None if norm.bias is None else norm.bias.float()
        return centered * norm.weight.float(), scale, bias
    if type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon"):
        scale = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + norm.variance_epsilon)  # [n, 1]
        return x * norm.weight.float(), scale, None
    raise TypeError(f"ffmem cannot split a {type(norm).__name__} final norm; add it to projection.norm_parts")


def value_logits(loaded: LoadedModel, values: torch.Tensor, readout: str) -> torch.Tensor:
    """Logits over the vocabulary for value rows (or any vectors): [keys, d] → [keys, vocab]."""
    unembedding = resolve(loaded.model, loaded.adapter.unembedding)
    read = readout_input(loaded, values, readout)  # [keys, d]
    return read @ unembedding.weight.T if readout == "raw" else unembedding(read)  # [keys, vocab]


def layer_logits(
    loaded: LoadedModel, layer: int, readout: str, chunk: int = 512
) -> Iterator[tuple[int, torch.Tensor]]:
    """(first key, float32 logits [chunk, vocab]) for the layer's values, a chunk of keys at a time."""
    block = loaded.adapter.blocks(loaded.model)[layer]
    values = loaded.adapter.value_matrix(block)  # [keys, d]
    with torch.inference_mode():
        for start in range(0, values.shape[0], chunk):
            yield (
                start,
                value_logits(loaded, values[start : start + chunk], readout).float(),
            )  # [chunk, vocab]


def project_layer(loaded: LoadedModel, layer: int, n: int = 30, chunk: int = 512) -> Iterator[ValueTokens]:
    """Top and bottom `n` tokens of every value of `layer`, for each readout."""
    for readout in READOUTS:
        parts = {1: [], -1: []}
        log_zs = []
        for _, logits in layer_logits(loaded, layer, readout, chunk):
            log_z = logits.logsumexp(dim=-1, keepdim=True)  # [chunk, 1]
            log_zs.append(log_z[:, 0])
            for direction in (1, -1):
                top, ids = logits.topk(n, dim=-1, largest=direction == 1)  # [chunk, n] each
                parts[direction].append((ids, top, (top - log_z).exp()))
        log_z = torch.cat(log_zs).cpu()  # [keys]
        for direction in (1, -1):
            ids, top, probs = (torch.cat(t).cpu() for t in zip(*parts[direction], strict=True))
            yield ValueTokens(layer, readout, direction, ids, top, probs, log_z)


def target_ranks(
    loaded: LoadedModel, layer: int, targets: torch.Tensor, readout: str = "raw", chunk: int = 512
) -> torch.Tensor:
    """Each target's 0-based rank in its value's full distribution: the number of tokens with a
    higher logit ([keys] token ids in, [keys] ranks out; −1 where the target is −1)."""
    ranks = []
    for start, logits in layer_logits(loaded, layer, readout, chunk):
        target = targets[start : start + logits.shape[0]].to(logits.device)[:, None]  # [chunk, 1]
        own = logits.gather(1, target.clamp(min=0))  # [chunk, 1]
        rank = (logits > own).sum(dim=-1)  # [chunk]
        ranks.append(torch.where(target[:, 0] >= 0, rank, -1))
    return torch.cat(ranks).cpu()  # [keys]
