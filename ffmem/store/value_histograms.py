"""Each value's logits over the whole vocabulary, binned (the `value_histograms` table, one row per run,
layer and key; numpy, no torch): what the key page's statistics panel draws. The index build computes
them in the projection's pass (ffmem.engine.values.projection.ValueHistogram) and stores them with the value
tokens, so a run still mining shows them.

A row's `data` is a width byte (the counts' bytes: 2 when the layer's largest count is below 65,536, else 4),
then one record per readout, in READOUTS order (raw, then norm):

    low     float32         the value's lowest logit under the readout
    high    float32         its highest
    counts  uint[bins]      tokens per bin: bin b holds the logits from low + b·w to low + (b + 1)·w,
                            w = (high − low) / bins, the highest in the last bin; they sum to the
                            vocabulary size

1 + 2 · (8 + width · bins) bytes, always odd (145 B a memory at 32 bins of uint16); `bins` is read off the
blob's length. Before revision 0031 a row held the records alone with uint32 counts (8 + 4·bins bytes a
readout, always even: read as they were written).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from ffmem.store import memory_lists
from ffmem.store.bulk import bulk_insert
from ffmem.store.memory_lists import READOUTS
from ffmem.store.models import ValueHistogram

COLUMNS = ("run_id", "layer", "key", "data")


def histogram_record(bins: int, width: int = 4) -> np.dtype:
    """One readout's histogram as stored with counts of 2 or 4 bytes (8 + width·bins B)."""
    return np.dtype([("low", "<f4"), ("high", "<f4"), ("counts", f"<u{width}", (bins,))])


@dataclass(frozen=True)
class LogitHistogram:
    """A value's logits over the whole vocabulary under one readout: `counts` per equal bin from `low` to
    `high`."""

    low: float
    high: float
    counts: list[int]

    @property
    def edges(self) -> list[float]:
        """The bins' edges, low to high (bins + 1)."""
        bins = len(self.counts)
        return [self.low + (self.high - self.low) * b / bins for b in range(bins + 1)]


def encode(low: np.ndarray, high: np.ndarray, counts: np.ndarray) -> list[bytes]:
    """One blob per key from each readout's extremes [readouts, keys] and counts [readouts, keys, bins]
    (readouts in READOUTS order)."""
    counts = np.asarray(counts)
    if (
        counts.ndim != 3
        or counts.shape[0] != len(READOUTS)
        or not np.shape(low) == np.shape(high) == counts.shape[:2]
    ):
        raise ValueError(
            f"expected counts [readouts, keys, bins] and extremes [readouts, keys], readouts {READOUTS}; "
            f"got counts {counts.shape}"
        )
    width = 2 if counts.max(initial=0) < 2**16 else 4
    records = np.empty(counts.shape[1::-1], histogram_record(counts.shape[2], width))  # [keys, readouts]
    records["low"], records["high"], records["counts"] = (
        np.asarray(low).T,
        np.asarray(high).T,
        counts.transpose(1, 0, 2),
    )
    return memory_lists.row_bytes(bytes([width]), records.view(np.uint8).reshape(len(records), -1))


def decode(data: bytes) -> dict[str, LogitHistogram]:
    """A blob's histograms: readout → LogitHistogram."""
    width, offset = (4, 0) if len(data) % 2 == 0 else (data[0], 1)  # even: stored before 0031
    bins = ((len(data) - offset) // len(READOUTS) - 8) // width
    records = np.frombuffer(data, histogram_record(bins, width), offset=offset)  # [readouts]
    return {
        readout: LogitHistogram(float(r["low"]), float(r["high"]), r["counts"].tolist())
        for readout, r in zip(READOUTS, records, strict=True)
    }


def store_value_histograms(
    *,
    session: Session,
    run_id: int,
    layer: int,
    histograms: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> int:
    """Store one layer's value histograms, readout → (low [keys], high [keys], counts [keys, bins]), one
    row per key; returns the rows stored."""
    if set(histograms) != set(READOUTS):
        raise ValueError(f"value histograms need every readout {READOUTS}; got {sorted(histograms)}")
    low, high, counts = (np.stack(parts) for parts in zip(*(histograms[r] for r in READOUTS), strict=True))
    blobs = encode(low, high, counts)
    fixed = {"run_id": run_id, "layer": int(layer)}
    bulk_insert(
        session,
        ValueHistogram.__table__,
        COLUMNS[2:],
        zip(range(len(blobs)), blobs, strict=True),
        fixed=fixed,
    )
    return len(blobs)


def value_histogram(
    *, session: Session, run_id: int, layer: int, key: int
) -> dict[str, LogitHistogram] | None:
    """One memory's histograms, readout → LogitHistogram; None when the run stores none (a run from
    before revision 0022)."""
    where = (ValueHistogram.run_id == run_id, ValueHistogram.layer == layer, ValueHistogram.key == key)
    data = session.scalar(select(ValueHistogram.data).where(*where))
    return None if data is None else decode(data)


def iter_value_histograms(*, session: Session, run_id: int) -> Iterator[tuple[int, int, str, LogitHistogram]]:
    """Every histogram of the run as (layer, key, readout, histogram), by layer and key; streamed."""
    query = (
        select(ValueHistogram.layer, ValueHistogram.key, ValueHistogram.data)
        .where(ValueHistogram.run_id == run_id)
        .order_by(ValueHistogram.layer, ValueHistogram.key)
    )
    for layer, key, data in session.execute(query.execution_options(yield_per=1000)):
        for readout, histogram in decode(data).items():
            yield layer, key, readout, histogram
