"""Value logits over the vocabulary at bfloat16 speed, with answers that are the float32 ones.

On a CPU with bf16 dot products (avx512_bf16), [chunk, d] × [d, vocab] in bfloat16 with float32
accumulation runs several times faster than float32 (docs/benchmarks.md). Its logits L̃ are close to the
exact L = a·e_t (+ b_t), within a bound computed from the operands themselves, not a guess:

    a·e = ã·ẽ + δa·e + ã·δe            (ã = bf16(a), δa = a − ã; ẽ, δe likewise: exact identities)
    |δa·e| ≤ ‖δa‖·‖e‖,  |ã·δe| ≤ ‖ã‖·‖δe‖                        (Cauchy–Schwarz)
    |fl32(ã·ẽ) − ã·ẽ| ≤ γ_d·‖ã‖·‖ẽ‖,  γ_d = d·2⁻²⁴ / (1 − d·2⁻²⁴)   (the products of two bf16 are exact
                                                                 in float32: only the sums round)
    |L̃ − fl32(ã·ẽ)| ≤ 2⁻⁸ / (1 − 2⁻⁸) · |L̃|                      (the sum rounded to bf16, to nearest)

so |L̃_t − L_t| ≤ β_t = A·‖e_t‖ + B·R_t + OUT·|L̃_t| + C_t, with A = ‖δa‖, B = ‖ã‖, R_t = ‖δe_t‖ + γ_d‖ẽ_t‖,
and C_t the rounding of a bias add; every norm is taken with a slack of 2⁻¹⁰ for its own rounding.
Because δa and δe are the actual rounding errors (about 2⁻¹⁰ of a vector's norm, not the worst case's
2⁻⁸), β is tight enough that the n-th largest of L̃ − β (a lower bound of the true n-th largest logit)
leaves ~2n candidates per value at SmolLM2's shape (n = 30: 55–170), which are then recomputed exactly.

- `extreme_tokens`: every value's top and bottom n tokens with their exact logits: the candidates
  {t : L̃_t + β_t ≥ λ} hold the true top n (each has L_t ≥ λ), rescored in float32 products summed in
  float64; a value with more candidates than `capacity` is recomputed whole, the same way.

**Speed** (one thread does in a pass over a chunk what a matrix product does in a few cycles): the product
is widened into buffers reused chunk after chunk (`Bf16Buffers`, in huge pages); the candidates take one
vectorized pass for each segment's extremes and the row's Σ e^L̃ (ffmem.engine.values.vector_math), then
read token by token only the segments that can hold one (`_candidates`); rows are read as
one-dimensional slices, the form LLVM vectorizes.

What is read from L̃ itself, with its tolerance, is said where it is used (ffmem.engine.values.projection).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field, replace

import numba
import numpy as np
import torch

from ffmem.engine.allocator import large_empty
from ffmem.engine.model.adapters.base import resolve
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.values.vector_math import as_float32, exp_sum

ROUNDING = 2.0**-8  # bfloat16's unit roundoff (8 significant bits, to nearest)
OUT = ROUNDING / (1 - ROUNDING) + 2.0**-22  # the bf16 result's rounding, plus a float32 bias add
SLACK = 1 + 2.0**-10  # on every norm and on β: their own float32 rounding
MIN_SIZE = 2**22  # vocab × d from which the bf16 product pays (below, float32: tiny models stay exact)
CAPACITY = 512  # candidates kept per value and direction before it is recomputed whole
SEGMENT = 32  # tokens whose extremes the candidates' first pass keeps (`_candidates`)
SUPERSET = 4 * CAPACITY  # the candidates' superset held per value and direction before a slow read


def bf16_available() -> bool:
    """Whether this CPU has bf16 dot products (without them torch emulates bf16: slower than float32)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class Unembedding:
    """The output embedding prepared for bf16 products: its weight [vocab, d] float32 and bfloat16, its
    bias [vocab] float32 (zeros if none), and per token ‖e_t‖ (`norm`), R_t (`rounding`) and C_t
    (`bias_slack`), each with its slack."""

    weight: torch.Tensor  # [vocab, d] float32
    weight_bf16: torch.Tensor  # [vocab, d] bfloat16
    bias: torch.Tensor  # [vocab] float32
    norm: torch.Tensor  # [vocab] float32
    rounding: torch.Tensor  # [vocab] float32
    bias_slack: torch.Tensor  # [vocab] float32
    reused: dict = field(default_factory=dict, compare=False)  # (thread, rows) → Bf16Buffers

    @classmethod
    def of(cls, loaded: LoadedModel, bias: bool = True) -> Unembedding:
        """The model's, prepared once per output module (the weights do not change); without its bias
        where `bias` is False (the raw readout, v·Eᵀ)."""
        linear = resolve(loaded.model, loaded.adapter.unembedding)
        cached = _PREPARED.get(linear)
        if cached is None or cached.weight.shape != linear.weight.shape:
            cached = _PREPARED[linear] = cls.prepare(linear.weight, getattr(linear, "bias", None))
        return cached if bias else cached.without_bias()

    @staticmethod
    def forget(loaded: LoadedModel) -> None:
        """Drop the model's prepared copy (its bf16 weight: 0.5 GiB at Llama-3.2-1B) once the projection
        is done."""
        _PREPARED.pop(resolve(loaded.model, loaded.adapter.unembedding), None)

    def buffers(self, rows: int) -> Bf16Buffers:
        """The calling thread's buffers for chunks of up to `rows` values, kept with the prepared copy
        (so with and without its bias) until it is forgotten."""
        key = (threading.get_ident(), rows)
        if key not in self.reused:
            self.reused[key] = Bf16Buffers(rows, self.weight.shape[0])
        return self.reused[key]

    def without_bias(self) -> Unembedding:
        zeros = torch.zeros_like(self.bias)  # [vocab]
        return replace(self, bias=zeros, bias_slack=zeros + 1e-30)

    @classmethod
    def prepare(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Unembedding:
        with torch.inference_mode():
            weight = large_empty(weight.shape, torch.float32).copy_(weight.detach())  # [vocab, d]
            weight_bf16 = large_empty(weight.shape, torch.bfloat16).copy_(weight)  # [vocab, d]
            d = weight.shape[1]
            gamma = d * 2.0**-24 / (1 - d * 2.0**-24)
            rounded = weight_bf16.float()  # [vocab, d]
            rounding = (weight - rounded).norm(dim=1) + gamma * rounded.norm(dim=1)  # [vocab]
            bias = torch.zeros(weight.shape[0]) if bias is None else bias.detach().float()  # [vocab]
            return cls(
                weight=weight,
                weight_bf16=weight_bf16,
                bias=bias.contiguous(),
                norm=(weight.norm(dim=1) * SLACK).contiguous(),
                rounding=(rounding * SLACK).contiguous(),
                bias_slack=(bias.abs() * 2.0**-22 + 1e-30).contiguous(),
            )


_PREPARED: weakref.WeakKeyDictionary[torch.nn.Module, Unembedding] = weakref.WeakKeyDictionary()


class Bf16Buffers:
    """The memory a run of chunks reuses: the bf16 product and its logits, [rows, vocab] each (a fresh
    [512, 49,152] float32 is a hundred megabytes of page faults a chunk), in huge pages."""

    def __init__(self, rows: int, vocab: int):
        self.product = large_empty((rows, vocab), torch.bfloat16)  # [rows, vocab]
        self.logits = large_empty((rows, vocab), torch.float32)  # [rows, vocab]


@numba.njit(parallel=True, nogil=True, cache=True)
def _widen(product, bias, logits):
    """logits = float32(product) + bias: product [c, vocab] as the bf16 bits (uint16), bias [vocab]."""
    for row in numba.prange(product.shape[0]):
        for t in range(product.shape[1]):
            logits[row, t] = as_float32(np.int32(product[row, t]) << np.int32(16)) + bias[t]


@dataclass
class Bf16Logits:
    """One chunk's bf16 logits and what their bound needs: read [c, d] float32 (the exact inputs), logits
    [c, vocab] float32 (L̃, the bf16 product widened), rounding [c] (A = ‖δa‖) and norm [c] (B = ‖ã‖)."""

    read: torch.Tensor  # [c, d] float32
    logits: torch.Tensor  # [c, vocab] float32
    rounding: torch.Tensor  # [c] float32
    norm: torch.Tensor  # [c] float32

    @classmethod
    def of(cls, table: Unembedding, read: torch.Tensor, into: Bf16Buffers | None = None) -> Bf16Logits:
        """The chunk's logits, in `into`'s memory where given (then valid until its next chunk)."""
        read = read.detach().float().contiguous()  # [c, d]
        rounded = read.bfloat16()  # [c, d]
        into = into or Bf16Buffers(read.shape[0], table.weight.shape[0])
        product = torch.matmul(rounded, table.weight_bf16.T, out=into.product[: read.shape[0]])  # [c, vocab]
        logits = into.logits[: read.shape[0]]  # [c, vocab]
        _widen(product.view(torch.int16).numpy().view(np.uint16), table.bias.numpy(), logits.numpy())
        widened = rounded.float()  # [c, d]
        return cls(
            read=read,
            logits=logits,
            rounding=((read - widened).norm(dim=1) * SLACK).contiguous(),
            norm=(widened.norm(dim=1) * SLACK).contiguous(),
        )

    def _arguments(self, table: Unembedding) -> tuple[np.ndarray, ...]:
        return (
            self.logits.numpy(),
            self.rounding.numpy(),
            self.norm.numpy(),
            table.norm.numpy(),
            table.rounding.numpy(),
            table.bias_slack.numpy(),
        )


@dataclass
class Extremes:
    """One chunk's extreme tokens, exact: direction (+1 top, −1 bottom) → (logits [c, n] float32, token
    ids [c, n] int64), the largest (smallest) first as `topk` of the exact logits gives them; and each
    row's log Z [c] (see `extreme_tokens`)."""

    found: dict[int, tuple[torch.Tensor, torch.Tensor]]
    log_z: torch.Tensor  # [c] float32


def extreme_tokens(table: Unembedding, chunk: Bf16Logits, n: int, capacity: int = CAPACITY) -> Extremes:
    """Every row's top and bottom `n` tokens, exactly (module docstring), and its log Z: the log-sum-exp
    of the bf16 logits with the top candidates' terms (those that weigh most) taken exactly: off the
    float32 one by at most log(1 + (e^β* − 1)·Z_rest/Z) ≤ β*, β* the largest bound of the other tokens
    and Z_rest/Z their share of Z."""
    logits = chunk.logits  # [c, vocab]
    rows, vocab = logits.shape
    n = min(n, vocab)
    ids = np.zeros((rows, 2, capacity), np.int64)  # [c, directions, capacity]
    counts = np.zeros((rows, 2), np.int64)  # [c, directions]
    shift, sums = np.zeros(rows, np.float32), np.zeros(rows)  # [c] each: max L̃, Σ e^(L̃ − max L̃)
    _candidates(*chunk._arguments(table), n, ids, counts, shift, sums)
    exact = np.zeros((rows, 2, capacity), np.float32)  # [c, directions, capacity]
    _exact_logits(chunk.read.numpy(), table.weight.numpy(), table.bias.numpy(), ids, counts, exact)
    found, held = {}, {}
    for slot, direction in enumerate((1, -1)):
        kept = torch.from_numpy(np.minimum(counts[:, slot], capacity))  # [c]
        held[direction] = torch.arange(capacity)[None, :] < kept[:, None]  # [c, capacity]
        scores = torch.from_numpy(exact[:, slot]).masked_fill(~held[direction], -direction * torch.inf)
        top, where = scores.topk(n, dim=1, largest=direction == 1)  # [c, n] each
        found[direction] = [top, torch.from_numpy(ids[:, slot]).gather(1, where)]
    # log Z: Σ exp(L̃ − m) over all tokens, the top candidates' terms swapped for their exact ones
    candidates = torch.from_numpy(ids[:, 0])  # [c, capacity]
    high = found[1][0][:, :1]  # [c, 1]: the exact largest logit (every L̃ − high ≤ β: no overflow)
    total = torch.from_numpy(sums) * (torch.from_numpy(shift) - high[:, 0]).double().exp()  # [c]
    approximate = (logits.gather(1, candidates) - high).exp() * held[1]  # [c, capacity]
    exact_terms = (torch.from_numpy(exact[:, 0]) - high).exp() * held[1]  # [c, capacity]
    swapped = (total - approximate.sum(dim=1)).clamp_min(0) + exact_terms.sum(dim=1)  # [c]
    log_z = (high[:, 0] + swapped.log()).float()  # [c]
    overflow = np.flatnonzero((counts > capacity).any(axis=1))
    if len(overflow):  # too many candidates (a value near no token): the whole row, exactly
        rows_exact = _exact_rows(chunk.read[overflow], table)  # [o, vocab]
        log_z[overflow] = rows_exact.logsumexp(dim=1)
        for direction in (1, -1):
            top, where = rows_exact.topk(n, dim=1, largest=direction == 1)  # [o, n] each
            found[direction][0][overflow], found[direction][1][overflow] = top, where
    return Extremes({direction: (top, where) for direction, (top, where) in found.items()}, log_z)


def _exact_rows(read: torch.Tensor, table: Unembedding) -> torch.Tensor:
    """Every token's exact logit for `read`'s rows ([o, d] float32), as `_dot` computes a candidate's (float32
    products summed in float64, plus the bias), whatever the CPU's float32 product would round: [o, vocab]
    float32. The output embedding is widened a block of tokens at a time."""
    rows = read.double()  # [o, d]
    vocab, d = table.weight.shape
    step = max(1, 2**22 // d)  # tokens a block: 32 MiB of float64
    logits = torch.empty(len(read), vocab)  # [o, vocab]
    for start in range(0, vocab, step):
        block = slice(start, start + step)
        logits[:, block] = rows @ table.weight[block].double().T + table.bias[block].double()  # [o, b]
    return logits


@numba.njit(nogil=True, inline="always")
def _bound(x, a, b, norm_t, rounding_t, slack_t):
    return (a * norm_t + b * rounding_t + OUT * abs(x)) * SLACK + slack_t


@numba.njit(nogil=True, inline="always")
def _insert(kept, value):
    """Insert value into kept (descending, its last the smallest kept) if it beats the last."""
    at = kept.shape[0] - 1
    if value <= kept[at]:
        return
    while at > 0 and value > kept[at - 1]:
        kept[at] = kept[at - 1]
        at -= 1
    kept[at] = value


@numba.njit(parallel=True, nogil=True, cache=True, fastmath={"nnan", "nsz"})
def _candidates(logits, rounding, norm, token_norm, token_rounding, token_slack, n, ids, counts, shift, sums):
    """Per row of logits [c, vocab]: λ₊ the n-th largest of L̃ − β and λ₋ that of −L̃ − β (lower bounds
    of the true n-th largest and of minus the n-th smallest), then the tokens with L̃ + β ≥ λ₊ into
    ids[row, 0] and those with −L̃ + β ≥ λ₋ into ids[row, 1], in token order (the first `capacity` of
    each; counts [c, 2] says how many there were); and shift[row] = max L̃, sums[row] = Σ e^(L̃ − max L̃).

    Two passes over the row, the first vectorized: each segment's max and min of L̃, and from them, with
    β* ≥ every β_t of the row (`_bound` of the row's largest |L̃| and terms: it grows with each), a
    threshold λ⁰ = (n-th largest segment extreme) − β* ≤ λ (n tokens reach that extreme, each with
    ±L̃ − β ≥ λ⁰). The second sums the exponentials and reads only the segments whose extreme + β* reaches
    λ⁰: there the tokens with ±L̃ + β ≥ λ⁰, a superset of those with ±L̃ − β ≥ λ and of the candidates,
    give λ exactly and then the candidates. A row whose superset overflows is read token by token."""
    rows, vocab = logits.shape
    capacity = ids.shape[2]
    segments = (vocab + SEGMENT - 1) // SEGMENT
    norm_max, rounding_max, slack_max = token_norm.max(), token_rounding.max(), token_slack.max()
    for row in numba.prange(rows):
        x = logits[row]
        a, b = rounding[row], norm[row]
        extremes = np.empty((2, segments), np.float32)  # [±, segments]: max L̃ and max −L̃
        for s in range(segments):
            start = s * SEGMENT
            high = low = x[start]
            for t in range(start + 1, min(start + SEGMENT, vocab)):
                high = max(high, x[t])
                low = min(low, x[t])
            extremes[0, s], extremes[1, s] = high, -low
        top, bottom = extremes[0].max(), -extremes[1].max()
        widest = _bound(max(top, -bottom), a, b, norm_max, rounding_max, slack_max)  # β*
        shift[row] = top
        sums[row] = exp_sum(x, top)
        for slot in range(2):
            sign = 1.0 if slot == 0 else -1.0
            kept = np.full(n, -np.inf)  # float64: λ is not rounded up
            if n <= segments:
                for s in range(segments):
                    _insert(kept, extremes[slot, s] - widest)
            floor = kept[n - 1]  # λ⁰ (−inf where the segments are fewer than n)
            found = np.empty(SUPERSET, np.int64)  # the superset's tokens
            reach = np.empty(SUPERSET)  # their ±L̃ + β
            kept[:] = -np.inf
            seen = 0
            for s in range(segments):
                if extremes[slot, s] + widest < floor:
                    continue
                for t in range(s * SEGMENT, min(s * SEGMENT + SEGMENT, vocab)):
                    beta = _bound(x[t], a, b, token_norm[t], token_rounding[t], token_slack[t])
                    if sign * x[t] + beta >= floor:
                        if seen < SUPERSET:
                            found[seen], reach[seen] = t, sign * x[t] + beta
                            _insert(kept, sign * x[t] - beta)
                        seen += 1
            if seen > SUPERSET:  # too many to hold: the row token by token
                counts[row, slot] = _scan(
                    x, a, b, token_norm, token_rounding, token_slack, n, sign, ids[row, slot]
                )
                continue
            limit, taken = kept[n - 1], 0
            for j in range(seen):
                if reach[j] >= limit:
                    if taken < capacity:
                        ids[row, slot, taken] = found[j]
                    taken += 1
            counts[row, slot] = taken


@numba.njit(nogil=True)
def _scan(x, a, b, token_norm, token_rounding, token_slack, n, sign, ids):
    """`_candidates` for one row and direction, token by token: λ the n-th largest of ±L̃ − β, then the
    tokens with ±L̃ + β ≥ λ into ids (the first `capacity`); returns how many there were."""
    kept = np.full(n, -np.inf)
    for t in range(x.shape[0]):
        _insert(kept, sign * x[t] - _bound(x[t], a, b, token_norm[t], token_rounding[t], token_slack[t]))
    taken = 0
    for t in range(x.shape[0]):
        if sign * x[t] + _bound(x[t], a, b, token_norm[t], token_rounding[t], token_slack[t]) >= kept[n - 1]:
            if taken < ids.shape[0]:
                ids[taken] = t
            taken += 1
    return taken


@numba.njit(nogil=True, inline="always")
def _dot(read, weight, bias, row, t):
    """The exact logit: float32 products summed in float64, plus the bias (rows read as one-dimensional
    slices: what LLVM vectorizes)."""
    a, e = read[row], weight[t]
    total = 0.0
    for i in range(a.shape[0]):
        total += np.float64(a[i]) * np.float64(e[i])
    return total + bias[t]


EXACT_MATH = {"reassoc", "contract", "nsz"}  # the float64 sums vectorized (no infinities there)


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=EXACT_MATH)
def _exact_logits(read, weight, bias, ids, counts, exact):
    """exact[row, s, j] = the exact logit of token ids[row, s, j], for the first counts[row, s]."""
    rows, slots, capacity = ids.shape
    for row in numba.prange(rows):
        for s in range(slots):
            for j in range(min(counts[row, s], capacity)):
                exact[row, s, j] = _dot(read, weight, bias, row, ids[row, s, j])
