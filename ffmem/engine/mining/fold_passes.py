"""The torch fold's passes over a group's coefficients (ffmem.engine.mining.fold_torch): one pure function
from a group's [layers, batch, pos, keys] coefficients (and a gated layer's inputs x·u) to what the fold
keeps of them, per sentence and key ([.., layers, batch, keys]) and per key ([layers, keys, ..]), in two
forms. Run as it is (the eager fold), `reductions`: each operation a pass over the group, as few as torch
allows. Compiled (`compiled`, torch.compile; an option: compiling takes a minute, a GPU needs triton),
`fused_reductions`: every reduction over a row's positions of an expression of c, u and the mined flags
alone, so that inductor reads c twice, in one loop nest for all the reductions and one for the histogram's
scatter, and writes no tensor of c's shape (on a CPU 1.6 times as fast as `reductions` compiled, which
writes three filled copies of c and reads them five times: docs/benchmarks.md, bench.torch_fold --reads);
on a GPU not yet measured. Both give the fold the same state, bit for bit.

`reductions`' passes, few as torch allows. An ungated layer's are seven: the fill of unmined positions
with their row's first mined coefficient, the maximum and the minimum with their positions, the sum, and
the histogram's codes (a shift, the keys' offsets, one scatter-add). The fill serves them all: it changes
no extreme, and the copies it makes are taken back out of the sum and the histogram from the [layers,
batch, keys] first coefficients alone (no zeroing pass). A gated layer's sign quadrants add comparisons
and byte-wide logic on the signs of m and x·u, counted in 16-bit sums, and per input sign one masked copy
read by a maximum and a minimum: over the positions whose input is ≥ 0 the
largest m ≥ 0 is pp's largest |m| and the smallest m < 0 np's; over those whose input is < 0 the largest
m > 0 is nn's and the smallest m ≤ 0 pn's (m = gate · input: a zero input has a zero m).

Every shape is fixed by the group's: no value is read back to the host.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ffmem.engine.mining.bins import CODE_STRIDE, CODES
from ffmem.engine.mining.mined_layer import N_BINS


class Reductions(NamedTuple):
    """What the fold keeps of a group's coefficients; the quadrants' fields None where not gated."""

    extreme: torch.Tensor  # [signs, layers, batch, keys]: each row's maximum (+1) and minimum (−1)
    at: torch.Tensor  # like extreme: its first mined position (a row with nothing mined: its anchor)
    total: torch.Tensor  # [layers, keys] float64: the sum of the mined coefficients
    histogram: torch.Tensor  # [layers, keys, bins] int64: their histogram
    quadrant_count: torch.Tensor | None  # [layers, keys, 4]: mined positions in pp, pn, np, nn
    quadrant_extreme: torch.Tensor | None  # [4, layers, batch, keys]: each row's m of largest |m| there
    quadrant_at: torch.Tensor | None  # like quadrant_extreme: its first position there
    quadrant_present: torch.Tensor | None  # like quadrant_extreme: whether the row has a usable m there


def reductions(
    c: torch.Tensor,
    u: torch.Tensor | None,
    mined: torch.Tensor,
    anchor: torch.Tensor,
    key_offsets: torch.Tensor,
    code_bins: torch.Tensor,
    nan_outright: bool = False,
) -> Reductions:
    """A group's Reductions: `c` [layers, batch, pos, keys] float32 (read, not overwritten), `u` a gated
    layer's inputs x·u like it (None: not gated), `mined` [batch, pos] bool, `anchor` [batch] each row's
    first mined position (0: none), `key_offsets` [keys] int32 and `code_bins` [CODES] (TorchFold's).
    `nan_outright`: each row's first NaN found apart (compiled, a maximum may pass over a NaN)."""
    n_layers, n_keys = c.shape[0], c.shape[3]
    quadrants = (None,) * 4 if u is None else _quadrants(c, u, mined)
    has_mined = mined.any(dim=1)[None, :, None, None]  # [1, batch, 1, 1]
    # Unmined positions hold their row's first mined coefficient, which changes neither its maximum nor
    # its minimum. Where an extreme's first occurrence is such a copy, its first mined occurrence is the
    # anchor: the anchor holds that value and no mined position comes before it. A row with nothing mined
    # holds +0.0 throughout: its copies are taken back out like any row's.
    at_anchor = anchor[None, :, None, None].expand(n_layers, -1, 1, n_keys)  # [layers, batch, 1, keys]
    first = c.gather(2, at_anchor).masked_fill_(~has_mined, 0.0)  # like at_anchor
    filled = torch.where(mined[None, :, :, None], c, first)  # like c
    (high, high_at), (low, low_at) = filled.max(dim=2), filled.min(dim=2)  # [layers, batch, keys] each
    # [signs, layers, batch, keys]: the extremes and where they first are. A row's first NaN is both its
    # maximum and its minimum (torch.max's rule, and the compiled CPU fold's); compiled, said outright.
    extreme, at = torch.stack([high, low]), torch.stack([high_at, low_at])
    if nan_outright:
        nan = torch.isnan(filled).view(torch.uint8).max(dim=2)  # [layers, batch, keys] each: any, first
        has_nan = nan.values.bool()  # [layers, batch, keys]
        extreme, at = extreme.masked_fill(has_nan, float("nan")), torch.where(has_nan, nan.indices, at)
    at = torch.where(mined.expand(2, n_layers, -1, -1).gather(3, at), at, anchor[:, None])
    # The sum and the histogram of the filled c, less each row's copies of its first coefficient (an
    # infinite first one is summed as it is: its copies change no infinite sum).
    copies = mined.shape[1] - mined.sum(dim=1)  # [batch]: each row's unmined positions
    first = first[:, :, 0]  # [layers, batch, keys]
    finite = first.double().masked_fill(~torch.isfinite(first), 0.0)  # like first, float64
    total = filled.sum(dim=(1, 2), dtype=torch.float64)  # [layers, keys]
    total = total - (finite * copies[:, None]).sum(dim=1)
    histogram = _histogram(filled, first, copies, key_offsets, code_bins)
    return Reductions(extreme, at, total, histogram, *quadrants)


def _histogram(
    filled: torch.Tensor, first: torch.Tensor, copies: torch.Tensor, key_offsets: torch.Tensor, code_bins
) -> torch.Tensor:
    """[layers, keys, bins] counts of `filled` [layers, batch, pos, keys], less `copies` [batch] of each
    row's `first` [layers, batch, keys] (the fill of its unmined positions).

    Each float's sign and exponent (a code) is counted per layer and key with one scatter-add
    (torch.bincount would read its input's maximum back to the host), the copies taken back with a second
    over [layers, batch, keys], then the codes are folded into the histogram's bins.
    """
    n_layers, n_keys = filled.shape[0], filled.shape[3]
    offsets = _code_offsets(n_layers, key_offsets)[:, None]  # [layers, 1, keys]
    codes = (
        (filled.view(torch.int32) >> 23).view(n_layers, -1, n_keys).add_(offsets)
    )  # [layers, batch·pos, keys]
    ones = torch.ones(1, dtype=torch.int32, device=filled.device).expand(codes.numel())  # [codes]
    by_code = torch.zeros(n_layers * n_keys * CODE_STRIDE, dtype=torch.int32, device=filled.device)
    by_code.index_add_(0, codes.reshape(-1), ones)  # [layers · keys · CODE_STRIDE]
    copied = (first.view(torch.int32) >> 23).add_(offsets)  # [layers, batch, keys]
    taken = copies.int().neg()[:, None].expand(first.shape).reshape(-1)  # [layers · batch · keys]
    by_code.index_add_(0, copied.reshape(-1), taken)
    return _binned(by_code, n_layers, n_keys, code_bins)


def _code_offsets(n_layers: int, key_offsets: torch.Tensor) -> torch.Tensor:
    """[layers, keys] int32: what each layer's and key's codes are offset by in the scatter's counts."""
    layer_offsets = torch.arange(n_layers, dtype=torch.int32, device=key_offsets.device)  # [layers]
    return key_offsets + layer_offsets[:, None] * (len(key_offsets) * CODE_STRIDE)  # [layers, keys]


def _binned(by_code: torch.Tensor, n_layers: int, n_keys: int, code_bins: torch.Tensor) -> torch.Tensor:
    """[layers, keys, bins] int64: the scatter's counts `by_code` [layers · keys · CODE_STRIDE] int32
    folded into the histogram's bins (a key's slot past its codes dropped)."""
    by_code = by_code.view(n_layers, n_keys, CODE_STRIDE)[..., :CODES].long()  # [layers, keys, CODES]
    counts = torch.zeros((n_layers, n_keys, N_BINS), dtype=torch.long, device=by_code.device)
    return counts.index_add_(2, code_bins, by_code)  # [layers, keys, bins]


def _quadrants(c: torch.Tensor, u: torch.Tensor, mined: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Reductions' quadrant fields from `c` and `u` [layers, batch, pos, keys] and `mined` [batch, pos].

    A position's quadrant is the compiled fold's: 2·(gate < 0) + (input < 0), the gate negative where
    m < 0 < u or u < 0 < m. Three counts give the four: the mined positions with a negative gate, a
    negative input, and both (bytes summed in 16 bits along a row, then over rows). A NaN m has no negative
    gate and ranks nowhere."""
    mined = mined[None, :, :, None]  # [1, batch, pos, 1]
    # In place where a tensor is new: fewer allocations (on a CPU each a page fault a page).
    input_negative = u < 0  # [layers, batch, pos, keys]
    gate_negative = (c < 0).logical_and_(u > 0).logical_or_((c > 0).logical_and_(input_negative))  # like c
    usable = (c == c).logical_and_(mined)  # like c: mined, not NaN
    gate_negative.logical_and_(usable)
    input_negative.logical_and_(mined)
    gate, inputs = _count(gate_negative), _count(input_negative)  # [layers, keys] each
    counts = _quadrant_counts(mined, gate, inputs, _count(gate_negative.logical_and_(input_negative)))
    negative = _side_extremes(c, input_negative.logical_and_(usable))
    positive = _side_extremes(c, usable.logical_and_(input_negative.logical_not_()))  # usable, input ≥ 0
    return counts, *_by_quadrant(positive, negative)


def _count(flags: torch.Tensor) -> torch.Tensor:
    """[layers, keys]: the positions flagged in `flags` [layers, batch, pos, keys] bool (bytes summed in
    16 bits along a row, < 2¹⁵, then over the rows)."""
    return flags.view(torch.uint8).sum(dim=2, dtype=torch.int16).sum(dim=1)


def _quadrant_counts(mined, gate: torch.Tensor, inputs: torch.Tensor, both: torch.Tensor) -> torch.Tensor:
    """[layers, keys, 4]: the mined positions (`mined` [1, batch, pos, 1]) in pp, pn, np, nn from those
    with a negative gate, a negative input and both ([layers, keys] each)."""
    positions = mined.sum()  # 0-dim: the mined positions of the batch
    return torch.stack((positions - gate - inputs + both, inputs - both, gate - both, both), dim=-1)


def _by_quadrant(positive: tuple[torch.Tensor, ...], negative: tuple[torch.Tensor, ...]):
    """Reductions' quadrant_extreme, quadrant_at and quadrant_present ([4, layers, batch, keys] each: pp,
    pn, np, nn) from each input sign's (≥ 0, < 0) maximum, where, minimum, where and whether it has any."""
    extreme = torch.stack([positive[0], negative[2], positive[2], negative[0]])  # m's extreme
    at = torch.stack([positive[1], negative[3], positive[3], negative[1]])  # where it first is
    signs = torch.stack([extreme[0] >= 0, extreme[1] <= 0, extreme[2] < 0, extreme[3] > 0])  # like at
    present = signs & torch.stack([positive[4], negative[4], positive[4], negative[4]])  # whether it counts
    return extreme, at, present


def _side_extremes(c: torch.Tensor, side: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The maximum of `c` [layers, batch, pos, keys] over a row's positions in `side` (like c), where it
    first is, the minimum, where it first is, and whether the row has any ([layers, batch, keys] each): one
    masked copy, in which the other positions hold the row's first of the side (as unmined positions hold
    the first mined one), read by a maximum and a minimum."""
    # [layers, batch, 1, keys]: the side's first position (0: none), by max, not argmax (ten times slower
    # on a CPU), whose position is the first of the largest as well
    first = side.view(torch.uint8).max(dim=2, keepdim=True).indices
    masked = torch.where(side, c, c.gather(2, first))  # like c
    (high, high_at), (low, low_at) = masked.max(dim=2), masked.min(dim=2)  # [layers, batch, keys] each
    first = first.squeeze(2)  # [layers, batch, keys]

    def first_on_side(at: torch.Tensor) -> torch.Tensor:  # a copy's first occurrence is the side's first
        return torch.where(side.gather(2, at[:, :, None]).squeeze(2), at, first)

    any_on_side = side.gather(2, first[:, :, None]).squeeze(2)  # [layers, batch, keys]
    return high, first_on_side(high_at), low, first_on_side(low_at), any_on_side


def fused_reductions(
    c: torch.Tensor,
    u: torch.Tensor | None,
    mined: torch.Tensor,
    anchor: torch.Tensor,
    key_offsets: torch.Tensor,
    code_bins: torch.Tensor,
) -> Reductions:
    """`reductions`' fold state in a form whose compiled passes read `c` twice (docs/benchmarks.md, the
    compiled fold's reads): every per-row reduction over the positions of an expression of c, u and `mined`
    alone, so that inductor computes them all in one loop over the positions, and the histogram's codes in
    its scatter's. No filled copy: a maximum's unmined (or off-side) positions are −inf, a minimum's +inf,
    the sum's 0, the histogram's codes a spare slot past each key's. Where a row's extreme is such a fill
    (nothing mined, or every value of the row that infinity), its position is taken back to the anchor as
    a copy's is; a quadrant's extreme and position are then not `present`, as they are not in
    `reductions`. Eager, each of these is a pass of its own: the eager fold keeps `reductions`. NaN said
    outright, as `compiled` does. The quadrant counts' 16-bit sums keep inductor's loop scalar over the
    keys; counted in 32 bits it vectorises sixteen keys at a time and takes twice as long (twenty vector
    accumulators, most of them a value and a position)."""
    n_layers, n_keys = c.shape[0], c.shape[3]
    quadrants = (None,) * 4 if u is None else _fused_quadrants(c, u, mined)
    mined = mined[None, :, :, None]  # [1, batch, pos, 1]
    high, high_at = torch.where(mined, c, float("-inf")).max(dim=2)  # [layers, batch, keys] each
    low, low_at = torch.where(mined, c, float("inf")).min(dim=2)  # [layers, batch, keys] each
    nan = (torch.isnan(c) & mined).view(torch.uint8).max(dim=2)  # [layers, batch, keys] each: any, first
    has_nan = nan.values.bool()  # [layers, batch, keys]
    extreme = torch.stack([high, low]).masked_fill(has_nan, float("nan"))  # [signs, layers, batch, keys]
    at = torch.where(has_nan, nan.indices, torch.stack([high_at, low_at]))  # like extreme
    at = torch.where(mined[..., 0].expand(2, n_layers, -1, -1).gather(3, at), at, anchor[:, None])
    total = torch.where(mined, c, 0.0).sum(dim=2, dtype=torch.float64).sum(dim=1)  # [layers, keys]
    offsets = _code_offsets(n_layers, key_offsets)[:, None, None]  # [layers, 1, 1, keys]
    spare = offsets + (CODES - CODES // 2)  # like offsets: each key's slot past its codes
    codes = torch.where(mined, (c.view(torch.int32) >> 23) + offsets, spare)  # like c
    ones = torch.ones(1, dtype=torch.int32, device=c.device).expand(codes.numel())  # [codes]
    by_code = torch.zeros(n_layers * n_keys * CODE_STRIDE, dtype=torch.int32, device=c.device)
    by_code.index_add_(0, codes.reshape(-1), ones)  # [layers · keys · CODE_STRIDE]
    histogram = _binned(by_code, n_layers, n_keys, code_bins)  # [layers, keys, bins]
    return Reductions(extreme, at, total, histogram, *quadrants)


def _fused_quadrants(c: torch.Tensor, u: torch.Tensor, mined: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`_quadrants`' fields as fused_reductions computes them: no tensor written but the reductions'."""
    mined = mined[None, :, :, None]  # [1, batch, pos, 1]
    usable = (c == c) & mined  # [layers, batch, pos, keys]: mined, not NaN
    input_negative = u < 0  # like c
    gate_negative = ((c < 0) & (u > 0) | (c > 0) & input_negative) & usable  # like c
    gate, inputs = _count(gate_negative), _count(input_negative & mined)  # [layers, keys] each
    counts = _quadrant_counts(mined, gate, inputs, _count(gate_negative & input_negative))
    sides = []  # per input sign (≥ 0, < 0): [layers, batch, keys] each: max, where, min, where, any
    for side in (usable & ~input_negative, usable & input_negative):  # like c each
        high, high_at = torch.where(side, c, float("-inf")).max(dim=2)
        low, low_at = torch.where(side, c, float("inf")).min(dim=2)
        sides.append((high, high_at, low, low_at, side.view(torch.uint8).amax(dim=2).bool()))
    return counts, *_by_quadrant(*sides)


BACKEND = "inductor"  # torch.compile's backend for `compiled` (the suite's: aot_eager, no code generated)
_compiled: dict[tuple[str, bool], object] = {}


def compiled(fused: bool = True):
    """`fused_reductions` compiled by torch.compile (once a process and backend, for any shape: dynamic);
    `fused=False`: `reductions` compiled instead, NaN found apart (the compiled passes before
    fused_reductions, for bench.torch_fold)."""
    if (BACKEND, fused) not in _compiled:
        reduce = fused_reductions if fused else functools.partial(reductions, nan_outright=True)
        # inductor fuses at most 16 reductions into one CPU loop (config.cpp.max_horizontal_fusion_size):
        # fused_reductions has 20 over the positions of a gated group
        options = {"cpp.max_horizontal_fusion_size": 32} if BACKEND == "inductor" and fused else None
        _compiled[BACKEND, fused] = torch.compile(reduce, dynamic=True, backend=BACKEND, options=options)
    return _compiled[BACKEND, fused]
