"""The order of mined entries: a value and its sentence packed into one sortable int64 (ties go to the
earlier sentence, so the result does not depend on batches or shards), a stable first-k for short rows,
and the band samples' pseudo-random priority."""

from __future__ import annotations

import torch

# An empty slot's order key, order_key(−inf, sentence −1): −inf's bits (−2²³ as an int32) made
# order-preserving, a tie of 0. Only a −NaN ranks below it.
EMPTY_ORDER = (-(2**23) ^ 0x7FFFFFFF) << 32


def first_of_stable_sort(values: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the first `k` of a stable ascending sort along the last dimension, for short rows
    (the band samples' 2·SAMPLES): each entry's place is the number of entries before it (lower, or equal
    at a lower index), found by comparing every pair — a few elementwise kernels, where torch.sort launches
    a segmented radix sort (on a GPU a third of mining's time at 8B: 3.3 ms a layer and batch)."""
    n = values.shape[-1]
    index = torch.arange(n, device=values.device)  # [n]
    earlier = index[:, None] > index[None, :]  # [n, n]: j comes before i where equal
    lower = values[..., None, :] < values[..., :, None]  # [..., n, n]: values[j] < values[i]
    equal = values[..., None, :] == values[..., :, None]  # [..., n, n]
    place = (lower | (equal & earlier)).sum(dim=-1)  # [..., n]: a permutation of 0 … n − 1 each row
    at = place[..., None, :] == index[:k, None]  # [..., k, n]: which entry is at place r
    return (at * index).sum(dim=-1)  # [..., k]


def order_key(values: torch.Tensor, sentence: torch.Tensor) -> torch.Tensor:
    """One int64 per entry whose order is: value descending, then sentence ascending, empty last.

    The high 32 bits are the float32 value's bits made order-preserving as a signed integer; the
    low 32 bits are 2³²−1 − sentence (0 for an empty slot). A single topk then gives a total order,
    and the top-T is kept as these numbers alone (plus positions).
    """
    bits = values.float().contiguous().view(torch.int32)  # [keys, n]
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # [keys, n]: int order = float order
    tie = torch.where(sentence < 0, 0, 0xFFFFFFFF - sentence)  # [keys, n]
    return (ordered << 32) | tie


def unpack(order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of order_key: (values float32, sentence int64 with −1 for empty)."""
    ordered = (order >> 32).int()  # [keys, n]
    values = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).view(torch.float32)  # [keys, n]
    tie = order & 0xFFFFFFFF  # [keys, n]
    return values, torch.where(tie == 0, -1, 0xFFFFFFFF - tie)


def sample_priority(sentence: torch.Tensor, layers: int | slice, n_keys: int) -> torch.Tensor:
    """A pseudo-random 31-bit number per (key, sentence) of a layer ([keys, n] int64) or of consecutive
    layers ([layers, keys, n]), the same in every batch, shard and device, so the band samples do not
    depend on how the corpus was split. A multiply–xorshift hash in int64 arithmetic that never overflows."""
    if isinstance(layers, int):
        return sample_priority(sentence, slice(layers, layers + 1), n_keys)[0]
    memory = torch.arange(layers.start * n_keys, layers.stop * n_keys, device=sentence.device)
    memory = memory.view(-1, n_keys)  # [layers, keys]
    x = (sentence * 2654435761 % 2**32) ^ (memory[..., None] * 2246822519 % 2**32)  # [layers, keys, n]
    x = x ^ (x >> 16)
    x = x * 0x45D9F3B % 2**32
    x = x ^ (x >> 16)
    return x >> 1
