"""Value vectors → vocabulary: each value's top and bottom tokens under two readouts.

- raw:  v·Eᵀ, the paper's readout (E the output embedding, no bias, no norm).
- norm: lm_head(final_norm(v)), the model's own path from a residual to logits applied to v alone.
Probabilities are a softmax over the full vocabulary. Work is chunked over keys, on the model's
device, so all values of a 30-layer model project in one pass without holding [keys, vocab] for
more than a chunk at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ffmem.engine.adapters.base import resolve
from ffmem.engine.loading import LoadedModel
from ffmem.engine.vocab_search import BLOCK

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


def search_arrays(
    loaded: LoadedModel, log_z: Mapping[tuple[int, str], torch.Tensor]
) -> Iterator[tuple[str, int, np.ndarray]]:
    """What full-vocabulary token search reads (ffmem.engine.vocab_search, which says what each array
    holds), as (name, part, array): the values and output embedding in float16, and per value its log Z
    under both readouts (`log_z[layer, readout]`, from project_layer) and the final norm's scale and
    centre, so the web computes any token's logit in every value without torch."""
    blocks = loaded.adapter.blocks(loaded.model)
    unembedding = resolve(loaded.model, loaded.adapter.unembedding)
    stats = []
    norm = None
    with torch.inference_mode():
        for layer, block in enumerate(blocks):
            values = loaded.adapter.value_matrix(block)  # [keys, d]
            yield "values", layer, _compact(values)
            columns = [log_z[layer, "raw"].float().cpu(), log_z[layer, "norm"].float().cpu()]
            try:
                scale, center, weight, bias = norm_terms(loaded, values)  # [keys], [keys], [d], [d]
            except TypeError:  # a final norm with no linear form: the raw readout only
                nan = torch.full_like(columns[0], float("nan"))
                columns += [nan, nan]
            else:
                columns += [scale.cpu(), center.cpu()]
                norm = torch.stack([weight, bias])  # [2, d]
            stats.append(torch.stack(columns, dim=1))  # [keys, 4]
        yield "value_stats", 0, torch.cat(stats).numpy()
        if norm is not None:
            yield "norm", 0, norm.cpu().numpy()
        if getattr(unembedding, "bias", None) is not None:
            yield "head_bias", 0, unembedding.bias.float().cpu().numpy()
        weight = unembedding.weight  # [vocab, d]
        for part, start in enumerate(range(0, weight.shape[0], BLOCK)):
            yield "unembedding", part, _compact(weight[start : start + BLOCK])


def norm_terms(
    loaded: LoadedModel, vectors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The final norm as final_norm(x) = w ⊙ (x − μ(x)) · s(x) + b, per vector (norm_parts' split):
    [n, d] → (s [n], μ [n], w [d], b [d]), float32; μ = 0 for RMSNorm, b = 0 without a bias."""
    _, scale, bias = norm_parts(loaded, vectors)
    norm = resolve(loaded.model, loaded.adapter.final_norm)
    x = vectors.float()  # [n, d]
    center = x.mean(dim=-1) if isinstance(norm, torch.nn.LayerNorm) else x.new_zeros(x.shape[0])  # [n]
    weight = norm.weight.float()  # [d]
    return scale[:, 0], center, weight, bias if bias is not None else torch.zeros_like(weight)


def _compact(rows: torch.Tensor) -> np.ndarray:
    """float16 (half of float32, and finer than bfloat16), or float32 where float16 would overflow."""
    fits = rows.abs().max().item() < torch.finfo(torch.float16).max / 2 if rows.numel() else True
    return rows.to(torch.float16 if fits else torch.float32).cpu().numpy()
