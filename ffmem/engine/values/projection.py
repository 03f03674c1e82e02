"""Value vectors → vocabulary: each value's top and bottom tokens under two readouts.

- raw:  v·Eᵀ, the paper's readout (E the output embedding, no bias, no norm).
- norm: lm_head(final_norm(v)), the model's own path from a residual to logits applied to v alone.
Probabilities are a softmax over the full vocabulary. In the same pass, each value's histogram of
its logits over the whole vocabulary (HISTOGRAM_BINS equal bins from its lowest logit to its highest;
on a CPU one compiled loop, elsewhere torch). Work is chunked over keys, on the model's device, so all
values of a 30-layer model project in one pass without holding [keys, vocab] for more than a chunk at
a time. The same chunks fill the inverse, vocabulary → memories (ffmem.engine.values.token_memories), where
the caller passes its tables.

**Arithmetic.** On a CPU with bf16 dot products, at sizes where it pays (vocab × d ≥ bf16_logits.MIN_SIZE),
each chunk's product is taken in bfloat16 (ffmem.engine.values.bf16_logits) and what is stored keeps
these guarantees against the float32 readout:
- the top and bottom tokens are exactly the float32 readout's, with their exact logits (candidates chosen
  by a rigorous bound β_t ≥ |L̃_t − L_t|, then rescored); `low` and `high` of a histogram are exact too;
- log Z is the log-sum-exp of the bf16 logits with the top candidates' terms taken exactly: off by at most
  the largest β_t of the other tokens weighted by their share of Z (`extreme_tokens`); a stored
  probability is within that factor, e^{±…}, of the float32 one;
- a histogram's counts are those of the bf16 logits: only a token within β_t of a bin's edge may be
  counted in the bin beside it (the counts still sum to the vocabulary);
- the token → memories lists are filled from the bf16 logits: a listed score is within β_t of the
  float32 one, and memories whose scores are within that of each other may swap places at a list's end;
- `target_ranks` are exact: the bf16 product decides every token but those within their bound of the
  target's logit, which are computed exactly (ffmem.engine.values.bf16_ranks).
Elsewhere (a GPU, a tiny model, a CPU without bf16, or `arithmetic="float32"`) everything is float32.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numba
import numpy as np
import torch

from ffmem.engine.model.adapters.base import resolve
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.values.bf16_logits import (
    MIN_SIZE,
    Bf16Logits,
    Extremes,
    Unembedding,
    bf16_available,
    extreme_tokens,
)
from ffmem.engine.values.bf16_ranks import bf16_target_ranks
from ffmem.engine.values.token_memories import TokenMemories

READOUTS = ("raw", "norm")
ARITHMETIC = ("auto", "bf16", "float32")  # the chunks' product (module docstring); auto: bf16 where it pays
HISTOGRAM_BINS = 32  # equal bins of a value's logits, from its lowest to its highest


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
    histogram: ValueHistogram  # the readout's logit histograms (the same for both directions)


@dataclass
class ValueHistogram:
    """Every value of one layer read over the whole vocabulary under one readout: the histogram of its
    logits in equal bins from its lowest logit `low` to its highest `high`. With w = (high − low) / bins,
    a logit x falls in bin ⌊(x − low) · (bins / w)⌋ in float32 (the highest in the last bin; a value whose
    logits are all equal, in bin 0): the counts sum to the vocabulary size."""

    layer: int
    readout: str
    low: torch.Tensor  # [keys] float32
    high: torch.Tensor  # [keys] float32
    counts: torch.Tensor  # [keys, bins] int64


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


def uses_bf16(loaded: LoadedModel, arithmetic: str = "auto") -> bool:
    """Whether the chunks' product is taken in bfloat16 (module docstring)."""
    if arithmetic not in ARITHMETIC:
        raise ValueError(f"unknown arithmetic {arithmetic!r}; choose from {ARITHMETIC}")
    if arithmetic != "auto":
        return arithmetic == "bf16"
    weight = resolve(loaded.model, loaded.adapter.unembedding).weight  # [vocab, d]
    return loaded.device.type == "cpu" and weight.numel() >= MIN_SIZE and bf16_available()


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


def layer_extremes(
    loaded: LoadedModel, layer: int, readout: str, n: int, chunk: int = 512, arithmetic: str = "auto"
) -> Iterator[tuple[int, torch.Tensor, Extremes]]:
    """(first key, logits [chunk, vocab] float32, Extremes) for the layer's values a chunk at a time: the
    logits in the module docstring's arithmetic, the top (+1) and bottom (−1) n tokens exactly the
    float32 readout's, extreme first, and each value's log Z. In bf16, a chunk's logits are valid until
    the next chunk is asked for (their memory is reused)."""
    if not uses_bf16(loaded, arithmetic):
        for start, logits in layer_logits(loaded, layer, readout, chunk):
            found = {d: logits.topk(n, dim=-1, largest=d == 1) for d in (1, -1)}  # [chunk, n] each
            found = {d: (top.values, top.indices) for d, top in found.items()}
            yield start, logits, Extremes(found, logits.logsumexp(dim=-1))  # log Z [chunk]
        return
    table = Unembedding.of(loaded, bias=readout != "raw")
    values = loaded.adapter.value_matrix(loaded.adapter.blocks(loaded.model)[layer])  # [keys, d]
    into = table.buffers(min(chunk, values.shape[0]))  # each chunk's logits, in memory reused
    with torch.inference_mode():
        for start in range(0, values.shape[0], chunk):
            read = readout_input(loaded, values[start : start + chunk], readout)  # [chunk, d]
            part = Bf16Logits.of(table, read, into)
            yield start, part.logits, extreme_tokens(table, part, n)  # exact extremes, log Z


def project_layer(
    loaded: LoadedModel,
    layer: int,
    n: int = 30,
    chunk: int = 512,
    bins: int = HISTOGRAM_BINS,
    token_memories: Mapping[str, TokenMemories] | None = None,
    arithmetic: str = "auto",
) -> Iterator[ValueTokens]:
    """Top and bottom `n` tokens of every value of `layer`, for each readout, with its logit histogram;
    the layer's logits go into `token_memories[readout]` too, where given."""
    for readout in READOUTS:
        parts = {1: [], -1: []}
        log_zs, extremes, counts = [], [], []
        for start, logits, extremes_of in layer_extremes(loaded, layer, readout, n, chunk, arithmetic):
            found, log_z = extremes_of.found, extremes_of.log_z[:, None]  # log Z [chunk, 1]
            log_zs.append(log_z[:, 0])
            if token_memories is not None:
                token_memories[readout].add(layer * loaded.n_keys + start, logits, log_z[:, 0])
            for direction, (top, ids) in found.items():
                parts[direction].append((ids, top, (top - log_z).exp()))
            low, high = found[-1][0][:, :1], found[1][0][:, :1]  # [chunk, 1]: the extreme logits
            extremes.append((low[:, 0], high[:, 0]))
            counts.append(logit_histogram(logits, low, high, bins))  # [chunk, bins]
        log_z = torch.cat(log_zs).cpu()  # [keys]
        low, high = (torch.cat(t).cpu() for t in zip(*extremes, strict=True))  # [keys] each
        histogram = ValueHistogram(layer, readout, low, high, torch.cat(counts).cpu())
        for direction in (1, -1):
            ids, top, probs = (torch.cat(t).cpu() for t in zip(*parts[direction], strict=True))
            yield ValueTokens(layer, readout, direction, ids, top, probs, log_z, histogram)


def logit_histogram(logits: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bins: int) -> torch.Tensor:
    """Each row's counts in `bins` equal bins from its `low` to its `high` (ValueHistogram's rule):
    logits [n, vocab], low and high [n, 1] → [n, bins] int64. On a CPU one compiled pass over the logits
    (a fifth of torch's time there); elsewhere torch ops of fixed shapes (no wait on the host). The two
    give the same counts."""
    width = high - low  # [n, 1]
    scale = torch.where(width > 0, bins / width, torch.zeros_like(width))  # [n, 1]: 0 puts all in bin 0
    counts = _histogram_compiled if logits.device.type == "cpu" else _histogram_torch
    return counts(logits, low, scale, bins)


def _histogram_torch(logits: torch.Tensor, low: torch.Tensor, scale: torch.Tensor, bins: int) -> torch.Tensor:
    index = ((logits - low) * scale).clamp_(0, bins - 1).long()  # [n, vocab]
    one = torch.ones(1, 1, dtype=torch.int64, device=logits.device).expand_as(index)  # [n, vocab]
    counts = torch.zeros(logits.shape[0], bins, dtype=torch.int64, device=logits.device)  # [n, bins]
    return counts.scatter_add_(1, index, one)


def _histogram_compiled(
    logits: torch.Tensor, low: torch.Tensor, scale: torch.Tensor, bins: int
) -> torch.Tensor:
    counts = np.zeros((logits.shape[0], bins), np.int64)  # [n, bins]
    _fill_histogram(logits.numpy(), low[:, 0].numpy(), scale[:, 0].numpy(), counts)
    return torch.from_numpy(counts)


@numba.njit(parallel=True, nogil=True, cache=True)
def _fill_histogram(logits: np.ndarray, low: np.ndarray, scale: np.ndarray, counts: np.ndarray) -> None:
    """Count each row of logits [n, vocab] float32 into counts [n, bins] (zeros), a row per thread, with
    _histogram_torch's float32 arithmetic: bin ⌊(x − low) · scale⌋, clamped to the bins."""
    last = counts.shape[1] - 1
    for row in numba.prange(logits.shape[0]):
        bottom, step = low[row], scale[row]
        for token in range(logits.shape[1]):
            b = int((logits[row, token] - bottom) * step)
            counts[row, min(max(b, 0), last)] += 1


def target_ranks(
    loaded: LoadedModel,
    layer: int,
    targets: torch.Tensor,
    readout: str = "raw",
    chunk: int = 512,
    arithmetic: str = "auto",
) -> torch.Tensor:
    """Each target's 0-based rank in its value's full distribution: the number of tokens with a
    higher logit ([keys] token ids in, [keys] ranks out; −1 where the target is −1). In bf16 arithmetic
    (module docstring) the rank among the exact logits, read off the bf16 product and each token within
    its bound of the target's logit computed exactly (ffmem.engine.values.bf16_ranks: equal to float32's
    rank but where float32 rounds a token's logit to a near-tie with the target's); elsewhere the rank
    among the float32 logits."""
    if uses_bf16(loaded, arithmetic):
        table = Unembedding.of(loaded, bias=readout != "raw")
        values = loaded.adapter.value_matrix(loaded.adapter.blocks(loaded.model)[layer])  # [keys, d]
        into = table.buffers(min(chunk, values.shape[0]))
        with torch.inference_mode():
            return torch.cat(
                [
                    bf16_target_ranks(
                        table,
                        Bf16Logits.of(
                            table, readout_input(loaded, values[start : start + chunk], readout), into
                        ),
                        targets[start : start + chunk].cpu(),
                    )
                    for start in range(0, values.shape[0], chunk)
                ]
            )  # [keys]
    ranks = []
    for start, logits in layer_logits(loaded, layer, readout, chunk):
        target = targets[start : start + logits.shape[0]].to(logits.device)[:, None]  # [chunk, 1]
        own = logits.gather(1, target.clamp(min=0))  # [chunk, 1]
        rank = (logits > own).sum(dim=-1)  # [chunk]
        ranks.append(torch.where(target[:, 0] >= 0, rank, -1))
    return torch.cat(ranks).cpu()  # [keys]
