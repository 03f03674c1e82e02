"""The token → memories table: for every vocabulary token, the memories whose value promotes it most and
those that suppress it most, under each readout, ranked by the token's logit and by its probability. Token
search answers from it (ffmem.web.token_search), so no process multiplies the value matrix per query.

Filled during the value projection (ffmem.engine.values.projection), which computes every value's logits over
the whole vocabulary a chunk of values at a time, [chunk, vocab], with each value's log Z: `TokenMemories.add`
takes each chunk, so the table costs no second product with the output embedding. Each token keeps its
`depth` best of each list so far, best first. On a CPU one compiled pass over the chunk compares each
logit with the worst kept score of each list (an insertion is rare once the lists are full: a pass at
memory speed); elsewhere torch merges the kept lists with the chunk's by `topk`, ops of fixed shapes (no
wait on the host). The two keep the same lists.

A memory is numbered layer-major: layer · keys + key. The lists, in their stored order (`LISTS`):
(by logit, promoting), (by logit, suppressing), (by probability, promoting), (by probability,
suppressing); a probability list ranks by log p = logit − log Z of the memory's value.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ffmem.engine.model.adapters.base import resolve
from ffmem.engine.model.loaded import LoadedModel

# (ranked by, direction) in stored order; the store, which may not import torch, names the same order
# memory_lists.TOKEN_LISTS (a test holds them equal). The compiled pass follows this order.
LISTS = (("logit", 1), ("logit", -1), ("prob", 1), ("prob", -1))


class TokenMemories:
    """The token → memories lists of one readout, filled a chunk of values at a time.

    Fewer memories than `depth`: the last slots hold memory −1 and score ∓inf (an empty slot ranks last).
    """

    def __init__(self, vocab: int, depth: int, device: torch.device | str = "cpu"):
        directions = torch.tensor([d for _, d in LISTS], dtype=torch.float32)  # [lists]
        self.memories = torch.full((vocab, len(LISTS), depth), -1, dtype=torch.int32, device=device)
        self.scores = (-directions[:, None] * torch.inf).expand(vocab, -1, depth).contiguous().to(device)
        self.floor = self.scores[:, :, -1].T.contiguous()  # [lists, vocab]: each list's worst kept score

    @classmethod
    def of(cls, loaded: LoadedModel, depth: int) -> TokenMemories:
        """Empty lists for every token the model's output embedding reads out, on its device."""
        vocab = resolve(loaded.model, loaded.adapter.unembedding).weight.shape[0]
        return cls(vocab, depth, loaded.device)

    def add(self, first: int, logits: torch.Tensor, log_z: torch.Tensor) -> None:
        """The logits [chunk, vocab] float32 of memories first … first + chunk − 1 and their values' log Z
        [chunk]."""
        (self._add_compiled if logits.device.type == "cpu" else self._add_torch)(first, logits, log_z)

    def _add_compiled(self, first: int, logits: torch.Tensor, log_z: torch.Tensor) -> None:
        kept = (self.memories.numpy(), self.scores.numpy(), self.floor.numpy())
        _keep_best(logits.numpy(), log_z.numpy(), first, *kept)

    def _add_torch(self, first: int, logits: torch.Tensor, log_z: torch.Tensor) -> None:
        (chunk, vocab), depth = logits.shape, self.scores.shape[2]
        owners = torch.arange(first, first + chunk, dtype=torch.int32, device=logits.device)  # [chunk]
        ranked_by = {"logit": logits.T, "prob": (logits - log_z[:, None]).T}  # [vocab, chunk] each
        for index, (by, direction) in enumerate(LISTS):
            kept = torch.cat([self.scores[:, index], ranked_by[by]], dim=1)  # [vocab, depth + chunk]
            top, where = kept.topk(depth, dim=1, largest=direction == 1)  # [vocab, depth] each
            held = torch.cat([self.memories[:, index], owners.expand(vocab, -1)], dim=1)  # like kept
            self.scores[:, index], self.memories[:, index] = top, held.gather(1, where)

    def lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(memories, scores): every token's `LISTS`, [vocab, lists, depth] int32 and float32 on the CPU,
        best first; the scores are logits or log-probabilities."""
        return self.memories.cpu(), self.scores.cpu()


@numba.njit(parallel=True, nogil=True, cache=True, fastmath={"nnan", "nsz"})
def _keep_best(
    logits: np.ndarray,
    log_z: np.ndarray,
    first: int,
    memories: np.ndarray,
    scores: np.ndarray,
    floor: np.ndarray,
) -> None:
    """Insert each of logits [chunk, vocab] (memory first + row) into its token's kept lists, memories and
    scores [vocab, lists, depth], where it beats the list's worst, floor [lists, vocab]; a block of tokens
    per thread, the chunk's rows in order (an equal score keeps the earlier memory first, as a stable
    sort does). A row's block is tested first in vector lanes, a flag a token (the floors a row's flags
    are read from change only at the token inserted); only the flagged tokens are read again."""
    chunk, vocab = logits.shape
    width = 256  # tokens a block: their lists stay in the L2 cache while the rows stream past
    for block in numba.prange((vocab + width - 1) // width):
        begin, end = block * width, min(block * width + width, vocab)
        flags = np.zeros(width, np.uint8)  # [width]: 1 where the row's logit beats a floor
        words = flags.view(np.uint64)  # eight flags a word: a word of zeros is skipped at once
        # the block's slices, read in one-dimensional loops: what LLVM vectorizes (2-D indexing: 10× slower)
        promote, suppress = floor[0, begin:end], floor[1, begin:end]
        promote_p, suppress_p = floor[2, begin:end], floor[3, begin:end]
        for row in range(chunk):
            z, x = log_z[row], logits[row]
            part = x[begin:end]
            for j in range(end - begin):
                logit = part[j]
                log_p = logit - z
                flags[j] = (
                    (logit > promote[j])
                    | (logit < suppress[j])
                    | (log_p > promote_p[j])
                    | (log_p < suppress_p[j])
                )
            for word in range((end - begin + 7) // 8):
                if words[word]:
                    for token in range(begin + 8 * word, min(begin + 8 * word + 8, end)):
                        if flags[token - begin]:
                            _insert(x[token], z, first + row, token, memories, scores, floor)


@numba.njit(nogil=True, inline="always")
def _insert(logit, z, memory, token, memories, scores, floor):
    """The memory's logit (and log p = logit − z) into the token's lists it beats."""
    depth = scores.shape[2]
    log_p = logit - z
    for index in range(4):
        sign = 1.0 if index % 2 == 0 else -1.0  # LISTS: promoting, suppressing, …
        score = logit if index < 2 else log_p
        if sign * score <= sign * floor[index, token]:
            continue
        at = depth - 1
        while at > 0 and sign * score > sign * scores[token, index, at - 1]:
            scores[token, index, at] = scores[token, index, at - 1]
            memories[token, index, at] = memories[token, index, at - 1]
            at -= 1
        scores[token, index, at] = score
        memories[token, index, at] = memory
        floor[index, token] = scores[token, index, depth - 1]
