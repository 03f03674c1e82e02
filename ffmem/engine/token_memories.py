"""The token → memories table: for every vocabulary token, the memories whose value promotes it most and
those that suppress it most, under each readout, ranked by the token's logit and by its probability. Token
search answers from it (ffmem.web.token_search), so no process multiplies the value matrix per query.

Computed after the value projection (which gives each value's log Z), a block of vocabulary tokens at a
time: the block's logits in every memory's value, [block, memories] = E_block · Xᵀ with X the values
(raw) or final_norm(values) (norm), then `topk` along each row. A row spans every memory of every layer,
so `topk` keeps `depth` of hundreds of thousands: a pass at memory speed, where merging running lists
chunk by chunk would sort millions of candidates.

A memory is numbered layer-major: layer · keys + key. The lists, in their stored order (`LISTS`):
(by logit, promoting), (by logit, suppressing), (by probability, promoting), (by probability,
suppressing); a probability list ranks by log p = logit − log Z of the memory's value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ffmem.engine.adapters.base import resolve
from ffmem.engine.loading import LoadedModel
from ffmem.engine.projection import readout_input

# (ranked by, direction) in stored order; the store, which may not import torch, names the same order
# memory_lists.TOKEN_LISTS (a test holds them equal).
LISTS = (("logit", 1), ("logit", -1), ("prob", 1), ("prob", -1))


def token_table(
    loaded: LoadedModel,
    readout: str,
    log_z: torch.Tensor,
    depth: int,
    block: int = 256,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(memories, scores) of every vocabulary token under `readout`: its `LISTS`, [vocab, lists, depth]
    int32 and float32 on the CPU, best first; the scores are logits or log-probabilities. `log_z` is every
    value's log-sum-exp over the vocabulary under `readout` ([memories], layer-major, from the projection).
    Fewer memories than `depth`: the last slots hold memory −1 and score ∓inf. `progress(done, vocab)`
    after each block of tokens."""
    blocks = loaded.adapter.blocks(loaded.model)
    unembedding = resolve(loaded.model, loaded.adapter.unembedding)
    embedding = unembedding.weight  # [vocab, d]
    bias = getattr(unembedding, "bias", None) if readout == "norm" else None  # raw: v·E, no bias
    vocab = embedding.shape[0]
    with torch.inference_mode():
        # What the output embedding reads of every value, one layer at a time (one [memories, d] copy).
        read = torch.cat([readout_input(loaded, loaded.adapter.value_matrix(b), readout) for b in blocks])
        log_z = log_z.to(read.device, torch.float32)  # [memories]
        k = min(depth, read.shape[0])
        memories = torch.full((vocab, len(LISTS), depth), -1, dtype=torch.int32)
        directions = torch.tensor([d for _, d in LISTS], dtype=torch.float32)  # [lists]
        scores = (-directions[:, None] * torch.inf).expand(vocab, -1, depth).clone()  # [vocab, lists, depth]
        for start in range(0, vocab, block):
            stop = min(start + block, vocab)
            logits = (embedding[start:stop] @ read.T).float()  # [block, memories]
            if bias is not None:
                logits += bias[start:stop, None].float()
            ranked_by = {"logit": logits, "prob": logits - log_z}  # [block, memories] each
            for index, (by, direction) in enumerate(LISTS):
                ranked = ranked_by[by]
                top, where = ranked.topk(k, dim=1, largest=direction == 1)  # [block, k] each
                memories[start:stop, index, :k] = where.to(torch.int32).cpu()
                scores[start:stop, index, :k] = top.cpu()
            if progress:
                progress(stop, vocab)
    return memories, scores
