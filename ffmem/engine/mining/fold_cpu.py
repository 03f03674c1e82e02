"""The mining fold on a CPU: one pass over a layer's coefficients per batch, compiled with numba.

Keys are split into one block per thread. Per sentence, one loop over its mined positions gives each
key's maximum and minimum (a vectorised loop), the sum and the histogram (a float's sign and exponent
bits name its bin through a 512-entry table); then, where the sentence's order key beats a list's last
one (the key's bar: each list's last order key, copied once a batch into arrays of their own and kept up to
date), it is inserted into the key's top-T of that sign or into its band samples, and only then is the
extreme's position looked up (its first occurrence). The state is the one the torch fold of other
devices (ffmem.engine.mining.fold_torch) gives, tested equal: the same order keys and ties, the same
positions.

A gated layer's sign quadrants (mined_layer.QUADRANTS) come in the same loop: each position's quadrant
from the signs of m and of its input x·u, counted, and per sentence the largest |m| in each quadrant,
entered into the quadrant's top examples as a trigger is.

Order keys and priorities are mining.order.order_key's and sample_priority's, restated for one entry.
"""

from __future__ import annotations

import numba
import numpy as np

from ffmem.engine.mining.mined_layer import SAMPLES


@numba.njit(inline="always")
def _order_key(bits: np.int32, sentence: np.int64) -> np.int64:
    """mining.order.order_key of one value (as its float32 bits) and sentence."""
    ordered = np.int64(bits ^ 0x7FFFFFFF if bits < 0 else bits)
    tie = 0 if sentence < 0 else 0xFFFFFFFF - sentence
    return (ordered << 32) | tie


@numba.njit(inline="always")
def _priority(sentence: np.int64, memory: np.int64) -> np.int64:
    """mining.order.sample_priority of one sentence and memory (layer · keys + key)."""
    x = ((sentence * 2654435761) & 0xFFFFFFFF) ^ ((memory * 2246822519) & 0xFFFFFFFF)  # all ≥ 0: % 2³²
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return x >> 1


@numba.njit(inline="always")
def _enter_top(order, position, key, entry, where):
    """Insert order key `entry` (at sentence position `where`), above the last one, into key's top-T,
    kept descending."""
    slot = order.shape[1] - 1
    while slot > 0 and order[key, slot - 1] < entry:
        order[key, slot] = order[key, slot - 1]
        position[key, slot] = position[key, slot - 1]
        slot -= 1
    order[key, slot] = entry
    position[key, slot] = where


@numba.njit(inline="always")
def _enter_sample(order, position, coefficient, key, band, entry, where, value):
    """Insert order key `entry`, below the last one, into key's band samples of bin `band`, kept ascending."""
    slot = SAMPLES - 1
    while slot > 0 and order[key, band, slot - 1] > entry:
        order[key, band, slot] = order[key, band, slot - 1]
        position[key, band, slot] = position[key, band, slot - 1]
        coefficient[key, band, slot] = coefficient[key, band, slot - 1]
        slot -= 1
    order[key, band, slot] = entry
    position[key, band, slot] = where
    coefficient[key, band, slot] = value


@numba.njit(inline="always")
def _quadrant(m, u):
    """A position's quadrant number: 2·(gate < 0) + (input < 0), the gate's sign being m / u's."""
    gate_negative = (m < 0 and u > 0) or (m > 0 and u < 0)
    return 2 * np.int64(gate_negative) + np.int64(u < 0)


@numba.njit(inline="always")
def _enter_quadrant(order, position, inputs, key, q, entry, where, value):
    """Insert order key `entry` (at `where`, input `value`), above the last one, into key's top examples
    of quadrant q, kept descending."""
    slot = order.shape[2] - 1
    while slot > 0 and order[key, q, slot - 1] < entry:
        order[key, q, slot] = order[key, q, slot - 1]
        position[key, q, slot] = position[key, q, slot - 1]
        inputs[key, q, slot] = inputs[key, q, slot - 1]
        slot -= 1
    order[key, q, slot] = entry
    position[key, q, slot] = where
    inputs[key, q, slot] = value


@numba.njit(inline="always")
def _first_in_quadrant(c, u, mined, row, key, q, magnitude):
    """The first mined position of `row` in quadrant q where key's |m| is `magnitude`."""
    for p in range(c.shape[1]):
        m, x = c[row, p, key], u[row, p, key]
        if mined[row, p] and abs(m) == magnitude and _quadrant(m, x) == q:
            return p
    return -1


@numba.njit(inline="always")
def _first_position(c, mined, row, key, value):
    """The first mined position of `row` where key's coefficient is `value` (NaN: the first NaN)."""
    for p in range(c.shape[1]):
        x = c[row, p, key]
        if mined[row, p] and (x == value or (x != x and value != value)):
            return p
    return -1


@numba.njit(parallel=True, nogil=True, cache=True)
def fold(
    c,  # [batch, pos, keys] float32
    mined,  # [batch, pos] bool
    sentence,  # [batch] int64: each row's sentence in the corpus
    first_memory,  # int64: layer · keys, the layer's first memory (for the priorities)
    code_bin,  # [512] int32: the histogram bin of each float32 sign and exponent code
    histogram,  # [keys, bins] int64
    total,  # [keys] float64
    high_order,  # [keys, T] int64: the top-T of s = +1 as order keys, best first
    high_position,  # [keys, T] int64: where in its sentence each is
    low_order,  # [keys, T] int64: the top-T of s = −1
    low_position,  # [keys, T] int64
    sample_order,  # [keys, bins, S] int64, lowest first
    sample_position,  # [keys, bins, S] int16
    sample_coefficient,  # [keys, bins, S] float32
    u,  # [batch, pos, keys] float32: a gated layer's inputs x·u (else unread)
    gated,  # bool: fold the quadrants too
    quadrant_count,  # [keys, 4] int64
    quadrant_order,  # [keys, 4, E] int64: order keys of |m|, best first
    quadrant_position,  # [keys, 4, E] int64
    quadrant_input,  # [keys, 4, E] float32: x·u there
    blocks,  # int: key blocks, one per thread
):
    """Fold one layer's coefficients for one batch into the layer's state (all arrays in place)."""
    n_rows, n_positions, n_keys = c.shape
    bits = c.view(np.int32)  # [batch, pos, keys]
    n_bins = histogram.shape[1]
    n_quadrants = quadrant_count.shape[1]
    for block in numba.prange(blocks):
        first, stop = block * n_keys // blocks, (block + 1) * n_keys // blocks
        width = stop - first
        high, low = np.empty(width, np.float32), np.empty(width, np.float32)
        high_bits, low_bits = high.view(np.int32), low.view(np.int32)
        nan = np.empty(width, np.bool_)
        counts = np.zeros((n_bins, width), np.int32)  # [bins, width]: this batch's histogram of the block
        sums = np.zeros(width, np.float64)
        # Gated: this batch's positions with a negative gate, a negative input, and both ([width] each: the
        # four counts follow from them and the positions), and the row's largest |m| in each quadrant
        # ([4, width], −1: none) — kept apart as vectors, so the loop below has no branch and no scatter.
        gate_negatives = np.zeros(width, np.int32)
        input_negatives = np.zeros(width, np.int32)
        both_negatives = np.zeros(width, np.int32)
        mined_positions = 0
        largest = np.empty((n_quadrants, width), np.float32)
        largest_bits = largest.view(np.int32)
        pp, pn, np_, nn = largest[0], largest[1], largest[2], largest[3]
        # The block's bars: the last order key of each key's top-T lists, quadrant lists and band samples,
        # which a row's entry must beat; read once a batch into arrays of their own, not once a row from
        # the lists (a cache line a key and list), and kept up to date as entries go in.
        high_bar, low_bar = high_order[first:stop, -1].copy(), low_order[first:stop, -1].copy()
        sample_bar = sample_order[first:stop, :, -1].copy()  # [width, bins]
        quadrant_bar = quadrant_order[first:stop, :, -1].copy()  # [width, 4] (gated; else unread)
        for row in range(n_rows):
            start = -1
            for p in range(n_positions):
                if not mined[row, p]:
                    continue
                value, code = c[row, p, first:stop], bits[row, p, first:stop]  # [width] each
                if start < 0:
                    start = p
                    high[:] = value
                    low[:] = value
                    nan[:] = False
                    largest[:] = -1.0
                for k in range(width):  # vectorised: no branch, no scatter
                    v = value[k]
                    high[k] = v if v > high[k] else high[k]
                    low[k] = v if v < low[k] else low[k]
                    nan[k] |= v != v
                    sums[k] += v
                for k in range(width):
                    counts[code_bin[(code[k] >> 23) & 511], k] += 1
                if gated:
                    mined_positions += 1
                    inputs = u[row, p, first:stop]  # [width]
                    for k in range(width):  # vectorised, as above; a NaN m is never the largest
                        m, x = value[k], inputs[k]
                        a = abs(m)
                        input_negative = x < 0
                        gate_negative = ((m < 0) & (x > 0)) | ((m > 0) & input_negative)
                        gate_negatives[k] += gate_negative
                        input_negatives[k] += input_negative
                        both_negatives[k] += gate_negative & input_negative
                        gate_positive, input_positive = not gate_negative, not input_negative
                        pp[k] = a if gate_positive & input_positive & (a > pp[k]) else pp[k]
                        pn[k] = a if gate_positive & input_negative & (a > pn[k]) else pn[k]
                        np_[k] = a if gate_negative & input_positive & (a > np_[k]) else np_[k]
                        nn[k] = a if gate_negative & input_negative & (a > nn[k]) else nn[k]
            if start < 0:
                continue  # nothing mined in this sentence: no trigger, no sample
            s = sentence[row]
            for k in range(width):
                key = first + k
                hi, lo, hi_bits, lo_bits = high[k], low[k], np.int64(high_bits[k]), np.int64(low_bits[k])
                if nan[k]:  # as torch's amax: the first NaN is the extreme
                    at = _first_position(c, mined, row, key, np.float32(np.nan))
                    hi = lo = c[row, at, key]
                    hi_bits = lo_bits = np.int64(bits[row, at, key])
                entry = _order_key(hi_bits, s)
                if entry > high_bar[k]:
                    _enter_top(high_order, high_position, key, entry, _first_position(c, mined, row, key, hi))
                    high_bar[k] = high_order[key, -1]
                entry = _order_key(lo_bits ^ -(2**31), s)
                if entry > low_bar[k]:
                    _enter_top(low_order, low_position, key, entry, _first_position(c, mined, row, key, lo))
                    low_bar[k] = low_order[key, -1]
                # A positive maximum is a sample of its (positive) bin, a negative minimum of its bin.
                sample = (_priority(s, first_memory + key) << 32) | s
                for value, value_bits, sign in ((hi, hi_bits, 1.0), (lo, lo_bits, -1.0)):
                    if value * sign > 0 and value * sign != np.inf:
                        band = code_bin[(value_bits >> 23) & 511]
                        if sample < sample_bar[k, band]:
                            where = _first_position(c, mined, row, key, value)
                            _enter_sample(
                                sample_order, sample_position, sample_coefficient, key, band, sample, where,
                                value,
                            )  # fmt: skip
                            sample_bar[k, band] = sample_order[key, band, -1]
            if gated:
                for k in range(width):
                    key = first + k
                    for q in range(n_quadrants):
                        if largest[q, k] < 0:
                            continue
                        entry = _order_key(np.int64(largest_bits[q, k]), s)
                        if entry > quadrant_bar[k, q]:
                            where = _first_in_quadrant(c, u, mined, row, key, q, largest[q, k])
                            read = u[row, where, key]
                            _enter_quadrant(
                                quadrant_order, quadrant_position, quadrant_input, key, q, entry, where, read
                            )
                            quadrant_bar[k, q] = quadrant_order[key, q, -1]
        for k in range(width):
            total[first + k] += sums[k]
            if gated:
                both, gate, negative = both_negatives[k], gate_negatives[k], input_negatives[k]
                quadrant_count[first + k, 0] += mined_positions - gate - negative + both
                quadrant_count[first + k, 1] += negative - both
                quadrant_count[first + k, 2] += gate - both
                quadrant_count[first + k, 3] += both
            for b in range(n_bins):
                histogram[first + k, b] += counts[b, k]
