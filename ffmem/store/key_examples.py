"""A key's examples beyond its top-T: band samples across its coefficient range, and its coefficient at every
token of the sentences its page shows (the `key_examples` table, one row per key; numpy, no torch).

While a run mines, the band samples come from its mined layers (MinedLayer.sample_order) and nothing is
shaded yet; a finished run stores both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from ffmem.engine.mined_layer import MinedLayer
from ffmem.store.models import KeyExamples
from ffmem.store.queries import _bulk_insert


@dataclass(frozen=True)
class BandSample:
    """A sentence whose extreme coefficient (its maximum when > 0, minimum when < 0) falls in `bin` of the
    run's histogram; the extreme is `coefficient`, at token `position`."""

    bin: int
    sentence_index: int
    position: int
    coefficient: float


def samples_of(mined: MinedLayer, key: int) -> list[BandSample]:
    """A key's band samples in a mined layer, by bin then slot."""
    sentence = mined.sample_sentence[key]  # [bins, S]
    bins, slots = np.nonzero(sentence >= 0)  # row-major: by bin, then slot
    return [
        BandSample(
            bin=int(b),
            sentence_index=int(sentence[b, s]),
            position=int(mined.sample_position[key, b, s]),
            coefficient=float(mined.sample_coefficient[key, b, s]),
        )
        for b, s in zip(bins, slots, strict=True)
    ]


def store_key_examples(
    *,
    session: Session,
    run_id: int,
    layer: int,
    mined: MinedLayer,
    positive: Sequence[Sequence[np.ndarray]],
    negative: Sequence[Sequence[np.ndarray]],
    samples: Sequence[Sequence[np.ndarray]],
) -> int:
    """Store one layer's rows: per key its band samples (from `mined`) and the shading of its first
    len(positive[key]) positive and len(negative[key]) negative triggers and of each sample (float16
    arrays, one per sentence, in samples_of's order). Returns the shading's bytes."""
    rows, size = [], 0
    for key in range(mined.histogram.shape[0]):
        found = samples_of(mined, key)
        assert len(samples[key]) == len(found), "one shading per band sample"
        shading = np.concatenate(
            [*positive[key], *negative[key], *samples[key], np.zeros(0, np.float16)]
        ).astype(np.float16)
        size += shading.nbytes
        listed = [[s.bin, s.sentence_index, s.position, s.coefficient] for s in found]
        rows.append((key, listed, len(positive[key]), len(negative[key]), shading.tobytes()))
    columns = ("run_id", "layer", "key", "samples", "positive", "negative", "shading")
    _bulk_insert(session, KeyExamples.__table__, columns, ((run_id, int(layer), *row) for row in rows))
    return size


@dataclass(frozen=True)
class StoredExamples:
    """A key's stored examples: its band samples and the shading of the sentences they and its first
    `positive` / `negative` triggers are in (split with `shading`)."""

    samples: list[BandSample]
    positive: int
    negative: int
    data: bytes

    def shading(self, lengths: Sequence[int]) -> list[np.ndarray]:
        """The stored arrays cut at these sentence lengths (positive triggers', negative's, samples')."""
        values = np.frombuffer(self.data, dtype=np.float16)
        ends = np.cumsum(lengths)
        if len(lengths) != self.positive + self.negative + len(self.samples) or (
            len(ends) and ends[-1] != len(values)
        ):
            raise ValueError("the stored shading does not match these sentences")
        return np.split(values, ends[:-1]) if len(lengths) else []


def key_examples(*, session: Session, run_id: int, layer: int, key: int) -> StoredExamples | None:
    """A finished run's stored examples of one key; None when it stored none (runs before 0011)."""
    row = session.scalars(
        select(KeyExamples).where(
            KeyExamples.run_id == run_id, KeyExamples.layer == layer, KeyExamples.key == key
        )
    ).first()
    if row is None:
        return None
    samples = [BandSample(int(b), int(s), int(p), float(c)) for b, s, p, c in row.samples]
    return StoredExamples(samples=samples, positive=row.positive, negative=row.negative, data=row.shading)
