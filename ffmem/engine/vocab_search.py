"""Full-vocabulary token search, without torch (the web process runs it): a token's logit in every
value's readout, for every memory of every layer, as one matrix–vector product over a run's values.

What the worker stores per run when it projects the values (ffmem/worker/search_arrays.py), each
array as .npy bytes in a `run_arrays` row (name, part):

- `values`, part = layer: V [keys, d] float16, row i the value v_i (the rows the value tokens read out);
- `unembedding`, part = block: rows [BLOCK · part, BLOCK · (part + 1)) of E [vocab, d], float16
  (a query reads the block of its token, not the whole matrix);
- `value_stats`, part 0: [layers · keys, 4] float32, per value: log Z under raw, log Z under norm
  (NaN where the final norm has no linear form), and the final norm's scale s_i and centre μ_i;
- `norm`, part 0: [2, d] float32, the final norm's weight w and bias b (0 without a bias);
- `head_bias`, part 0: [vocab] float32, only when the output embedding has a bias.

The two readouts, as the stored value tokens mean them (ffmem/engine/projection.py):

    raw:  logit(i, t) = v_i · e_t                                  (the paper's: no norm, no bias)
    norm: logit(i, t) = s_i · (v_i · (w ⊙ e_t) − μ_i · Σ(w ⊙ e_t)) + b · e_t + c_t
                      = lm_head(final_norm(v_i))[t]   with final_norm(x) = w ⊙ (x − μ(x)) · s(x) + b
                        (projection.norm_parts: μ the mean for LayerNorm, 0 for RMSNorm; c the head's bias)
    prob(i, t) = exp(logit(i, t) − log Z_i)

Memories are numbered layer-major: value index = layer · keys + key.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

BLOCK = 1024  # output-embedding rows per stored part
READOUTS = ("raw", "norm")
STAT_COLUMNS = ("log_z_raw", "log_z_norm", "norm_scale", "norm_center")


def to_npy(array: np.ndarray) -> bytes:
    """An array as .npy bytes (dtype and shape included; no pickles)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def from_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


@dataclass(frozen=True)
class TokenHit:
    """One memory's score for one searched token."""

    layer: int
    key: int
    token_id: int
    logit: float
    prob: float


@dataclass
class SearchArrays:
    """A run's arrays for token search, in memory: V as float32 (a matrix–vector product over it is
    memory-bound, ~106 MB for SmolLM2's 46,080 × 576) and the per-value terms of both readouts."""

    values: np.ndarray  # [layers · keys, d] float32
    n_keys: int
    stats: np.ndarray  # [layers · keys, 4] float32: STAT_COLUMNS
    norm: np.ndarray | None  # [2, d] float32: the final norm's weight and bias; None: raw only
    head_bias: np.ndarray | None  # [vocab] float32, or None

    @classmethod
    def from_parts(cls, values: Sequence[np.ndarray], singles: Mapping[str, np.ndarray]) -> SearchArrays:
        """From the stored `values` parts (in layer order) and the part-0 arrays by name."""
        stacked = np.concatenate([v.astype(np.float32, copy=False) for v in values])  # [layers · keys, d]
        stats = singles["value_stats"].astype(np.float32, copy=False)
        norm = singles.get("norm")
        if norm is not None and np.isnan(stats[:, 1]).any():
            norm = None  # the final norm had no linear form: raw only
        return cls(stacked, values[0].shape[0], stats, norm, singles.get("head_bias"))

    @property
    def n_values(self) -> int:
        return self.values.shape[0]

    @property
    def readouts(self) -> tuple[str, ...]:
        return READOUTS if self.norm is not None else READOUTS[:1]

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.stats.nbytes

    def logits(self, embedding: np.ndarray, token_ids: Sequence[int], readout: str) -> np.ndarray:
        """Each token's logit in every value's readout: E rows [m, d] of `token_ids` → [m, layers · keys]."""
        e = embedding.astype(np.float32, copy=False)  # [m, d]
        if readout == "raw":
            return (self.values @ e.T).T  # [m, n]
        if readout != "norm" or self.norm is None:
            raise ValueError(f"readout {readout!r} is not available; choose from {self.readouts}")
        weight, bias = self.norm  # [d] each
        query = e * weight  # [m, d]: w ⊙ e_t
        scale, center = self.stats[:, 2], self.stats[:, 3]  # [n] each
        linear = (self.values @ query.T).T - query.sum(axis=1, keepdims=True) * center  # [m, n]
        constant = e @ bias  # [m]: b · e_t
        if self.head_bias is not None:
            constant = constant + self.head_bias[list(token_ids)]
        return linear * scale + constant[:, None]

    def log_z(self, readout: str) -> np.ndarray:
        """[layers · keys]: each value's log-sum-exp over the vocabulary under `readout`."""
        return self.stats[:, READOUTS.index(readout)]

    def search(
        self, embedding: np.ndarray, token_ids: Sequence[int], *, readout: str, by: str, limit: int
    ) -> dict[int, list[TokenHit]]:
        """direction → the `limit` (memory, token) pairs whose value promotes (+1: the highest scores)
        or suppresses (−1: the lowest) one of `token_ids` most, over all memories of all layers; the score
        is the logit (`by="logit"`) or the log-probability (`"prob"`). Ties go to the lower layer, key."""
        logits = self.logits(embedding, token_ids, readout)  # [m, n]
        log_z = self.log_z(readout)  # [n]
        scores = logits if by == "logit" else logits - log_z
        found = {}
        for direction in (1, -1):
            rows, columns = strongest(scores, direction, limit)
            found[direction] = [
                TokenHit(
                    layer=int(c // self.n_keys),
                    key=int(c % self.n_keys),
                    token_id=int(token_ids[r]),
                    logit=float(logits[r, c]),
                    prob=float(np.exp(logits[r, c] - log_z[c])),
                )
                for r, c in zip(rows, columns, strict=True)
            ]
        return found


def strongest(scores: np.ndarray, direction: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) indices of the `limit` highest (direction +1) or lowest (−1) entries of the
    [tokens, memories] `scores`, strongest first; equal scores by memory, then token."""
    signed = scores if direction == 1 else -scores
    m, n = signed.shape
    flat = signed.T.ravel()  # memory-major: a flat index orders ties by memory, then token
    limit = min(limit, flat.size)
    if limit <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    chosen = np.argpartition(-flat, limit - 1)[:limit] if limit < flat.size else np.arange(flat.size)
    chosen = chosen[np.lexsort((chosen, -flat[chosen]))]
    columns, rows = np.divmod(chosen, m)
    return rows, columns
