"""A memory's value histograms packed as one blob (ffmem.store.value_histograms): the documented layout,
byte for byte (uint16 counts where they fit, uint32 past them), a blob stored before 0031 read as it was
written, and a round trip for any number of bins."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from ffmem.store.memory_lists import READOUTS
from ffmem.store.value_histograms import decode, encode


@pytest.mark.parametrize(("bins", "largest", "width"), [(1, 2**32, 4), (32, 2**16, 2), (50, 2**16 + 1, 4)])
def test_histograms_round_trip(bins, largest, width):
    rng = np.random.default_rng(bins)
    keys = 7
    low = rng.normal(-5, 1, (len(READOUTS), keys)).astype(np.float32)  # [readouts, keys]
    high = low + rng.uniform(0.5, 4, low.shape).astype(np.float32)
    counts = rng.integers(0, largest, (len(READOUTS), keys, bins), dtype=np.uint64)  # [readouts, keys, bins]
    counts[0, 0, 0] = largest - 1  # the largest count decides the width
    blobs = encode(low, high, counts)
    assert [len(b) for b in blobs] == [1 + len(READOUTS) * (8 + width * bins)] * keys
    assert {b[0] for b in blobs} == {width}
    for key, blob in enumerate(blobs):
        found = decode(blob)
        assert list(found) == list(READOUTS)
        for r, readout in enumerate(READOUTS):
            h = found[readout]
            assert (h.low, h.high) == (float(low[r, key]), float(high[r, key]))
            assert h.counts == counts[r, key].tolist()
            assert h.edges[0] == h.low and h.edges[-1] == pytest.approx(h.high) and len(h.edges) == bins + 1


def test_the_layout_is_low_high_and_counts_per_readout_raw_first():
    low, high = np.array([[-1.5], [-2.0]], np.float32), np.array([[2.5], [3.0]], np.float32)
    counts = np.array([[[3, 0, 5]], [[1, 6, 1]]])  # [readouts, 1 key, 3 bins]
    (blob,) = encode(low, high, counts)
    assert blob == b"\x02" + struct.pack("<ff3H", -1.5, 2.5, 3, 0, 5) + struct.pack(
        "<ff3H", -2.0, 3.0, 1, 6, 1
    )
    assert decode(blob)["norm"].edges == [-2.0, -2.0 + 5 / 3, -2.0 + 10 / 3, 3.0]


def test_a_blob_stored_before_0031_reads_as_written():
    """Before revision 0031 a blob held the records alone, uint32 counts (an even length)."""
    old = struct.pack("<ff3I", -1.5, 2.5, 3, 0, 70_000) + struct.pack("<ff3I", -2.0, 3.0, 1, 6, 1)
    found = decode(old)
    assert (found["raw"].low, found["raw"].high, found["raw"].counts) == (-1.5, 2.5, [3, 0, 70_000])
    assert (found["norm"].low, found["norm"].high, found["norm"].counts) == (-2.0, 3.0, [1, 6, 1])


def test_a_histogram_without_both_readouts_is_refused():
    with pytest.raises(ValueError, match="readouts"):
        encode(np.zeros((1, 2)), np.ones((1, 2)), np.zeros((1, 2, 4)))
