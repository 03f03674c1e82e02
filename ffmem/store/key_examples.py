"""A key's examples beyond its top-T: band samples across its coefficient range, its coefficient at every
token of the sentences its page shows, and a gated key's top examples per sign quadrant (the `key_examples`
table, one row per key; numpy, no torch).

While a run mines, the band samples come from its mined layers (MinedLayer.sample_order) and nothing is
shaded yet; a finished run stores both.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from itertools import repeat

import numpy as np
from sqlalchemy import null, select
from sqlalchemy.orm import Session

from ffmem.engine.mining.mined_layer import QUADRANTS, MinedLayer
from ffmem.store import memory_lists
from ffmem.store.bulk import bulk_insert
from ffmem.store.models import KeyExamples


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


@dataclass(frozen=True)
class QuadrantExample:
    """A sentence among a gated key's top examples of one sign quadrant (mined_layer.QUADRANTS): its
    largest |m| among the quadrant's positions, `coefficient` m at token `position`, where the input x·u
    is `input` (so the gate act(x·g) is m / input)."""

    quadrant: int
    sentence_index: int
    position: int
    coefficient: float
    input: float

    @property
    def gate(self) -> float | None:
        """act(x·g) = m / (x·u); None where the input is 0 (then m is 0 whatever the gate)."""
        return self.coefficient / self.input if self.input else None


# A quadrant example as stored before revision 0031: `quadrants` held a key's, by quadrant then rank (15 B
# each). From 0031 a blob is packed (`_pack`): PACKED, the widths of the sentence index and the position,
# then the examples' quadrant (1 B), sentence index, position, coefficient and input (float32): 12 B each
# for ≤ 65,535 sentences of ≤ 255 tokens. An old blob's first byte is a quadrant (≤ 3), never PACKED.
QUADRANT_EXAMPLE = np.dtype(
    [
        ("quadrant", "u1"),
        ("sentence_index", "<i4"),
        ("position", "<i2"),
        ("coefficient", "<f4"),
        ("input", "<f4"),
    ]
)
PACKED = 0x80  # the first byte of a packed `bands` or `quadrants` blob (an old one's is a bin or quadrant)


def _pack(columns: Sequence[np.ndarray], floats: int, counts: np.ndarray) -> list[bytes]:
    """Each key's part of flat [entries] columns (a 1-byte number, the sentence index, the position, then
    `floats` float32 ones), its `counts` [keys] entries, as packed blobs: PACKED, the two widths, the
    entries; the integers as wide as the layer's largest need; b"" for a key with none."""
    widths = (1, memory_lists.int_width(columns[1]), memory_lists.int_width(columns[2]))
    header = bytes([PACKED, *widths[1:]])
    packed = memory_lists.pack_columns(columns, (*widths, *[memory_lists.FLOAT] * floats))  # [entries, size]
    data = packed.tobytes()  # each key's entries a slice
    size = memory_lists.entry_bytes((*widths, *[memory_lists.FLOAT] * floats))
    ends = np.cumsum(counts) * size  # [keys]
    starts = ends - np.asarray(counts) * size  # [keys]
    return [header + data[a:b] if a < b else b"" for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]


def _unpack_entries(data: bytes, floats: int) -> list[tuple]:
    """A packed blob's entries as tuples (the number, sentence index, position, then the floats)."""
    widths = (1, data[1], data[2], *[memory_lists.FLOAT] * floats)
    size = memory_lists.entry_bytes(widths)
    raw = np.frombuffer(data, np.uint8, offset=3).reshape(-1, size)  # [entries, size]
    columns = memory_lists.unpack_columns(raw, widths, [False] * len(widths))
    return list(zip(*(c.tolist() for c in columns), strict=True))


def layer_quadrant_examples(mined: MinedLayer) -> list[bytes] | None:
    """Every key's quadrant examples packed (by quadrant, then rank); None for an ungated layer."""
    if not mined.gated:
        return None
    sentence = mined.quadrant_sentence  # [keys, 4, E]
    present = sentence >= 0  # [keys, 4, E]
    _, quadrant, _ = np.nonzero(present)  # row-major: by key, quadrant, rank
    columns = (
        quadrant,
        sentence[present],
        mined.quadrant_position[present],
        mined.quadrant_coefficient[present],
        mined.quadrant_input[present],
    )  # [examples] each
    return _pack(columns, 2, present.reshape(len(present), -1).sum(axis=1))


def decode_quadrant_examples(data: bytes) -> list[QuadrantExample]:
    """The quadrant examples a `quadrants` blob holds, in order."""
    rows = (
        _unpack_entries(data, 2)
        if data[:1] == bytes([PACKED])
        else np.frombuffer(data, QUADRANT_EXAMPLE).tolist()
    )
    return [QuadrantExample(int(q), int(s), int(p), float(c), float(u)) for q, s, p, c, u in rows]


def quadrant_examples_of(mined: MinedLayer, key: int) -> list[QuadrantExample] | None:
    """A key's quadrant examples in a mined layer, by quadrant then rank; None for an ungated layer."""
    if not mined.gated:
        return None
    found = []
    for quadrant in range(len(QUADRANTS)):
        for rank in np.flatnonzero(mined.quadrant_sentence[key, quadrant] >= 0).tolist():
            found.append(
                QuadrantExample(
                    quadrant=quadrant,
                    sentence_index=int(mined.quadrant_sentence[key, quadrant, rank]),
                    position=int(mined.quadrant_position[key, quadrant, rank]),
                    coefficient=float(mined.quadrant_coefficient[key, quadrant, rank]),
                    input=float(mined.quadrant_input[key, quadrant, rank]),
                )
            )
    return found


# A band sample as stored before revision 0031: `bands` held a key's samples as consecutive records (12 B
# each; an old blob's first byte is a bin, < 43). From 0031 packed as the quadrant examples are (`_pack`):
# the bin (1 B), sentence index, position, coefficient float32: 8 B for ≤ 65,535 sentences of ≤ 255 tokens.
BAND = np.dtype([("bin", "<i2"), ("sentence_index", "<i4"), ("position", "<i2"), ("coefficient", "<f4")])
NOT_MINED = -128  # the int8 code of NaN (a position the run does not mine); the others are −127 … 127
STEPS = 127  # codes on each side of 0: a sentence's step is its largest |m| / 127


def layer_bands(mined: MinedLayer) -> list[bytes]:
    """Every key's band samples packed (by bin, then slot; decode_bands reads them), the layer at once."""
    sentence = mined.sample_sentence  # [keys, bins, S]
    present = sentence >= 0  # [keys, bins, S]
    _, bins, _ = np.nonzero(present)  # row-major: by key, bin, slot, as boolean indexing reads them
    columns = (bins, sentence[present], mined.sample_position[present], mined.sample_coefficient[present])
    return _pack(columns, 1, present.reshape(len(present), -1).sum(axis=1))


def decode_bands(data: bytes) -> list[BandSample]:
    """The band samples a `bands` blob holds, in order."""
    rows = _unpack_entries(data, 1) if data[:1] == bytes([PACKED]) else np.frombuffer(data, BAND).tolist()
    return [BandSample(int(b), int(s), int(p), float(c)) for b, s, p, c in rows]


def encode_shading(values: np.ndarray, lengths: np.ndarray) -> bytes:
    """Coefficients at every token of some sentences (`values` [tokens] float32, NaN where not mined, cut
    into sentences by `lengths` [sentences]) as int8 codes with one float32 step per sentence: the steps
    [sentences] then the codes [tokens], sentence after sentence, deflated (zlib: about 0.7 of the bytes).
    A sentence's step is its largest |m| / 127, so its peak is stored to float32's precision and every
    value to within half a step (0.4 % of the peak); NaN is the code NOT_MINED."""
    steps, codes = _steps_and_codes(values, lengths)
    return zlib.compress(steps.tobytes() + codes.tobytes())


def _steps_and_codes(values: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """encode_shading's steps [sentences] float32 and codes [tokens] int8, any number of sentences at once
    (each sentence's own: a layer's together give each key's)."""
    lengths = np.asarray(lengths, np.int64)  # [sentences]
    values = np.asarray(values, np.float32)  # [tokens]
    peaks = np.zeros(len(lengths), np.float32)  # [sentences]: largest |m| (0 where nothing is mined)
    filled = lengths > 0
    if filled.any():  # fmax passes NaN (not mined) over; a sentence of NaN alone stays NaN: 0
        found = np.fmax.reduceat(np.abs(values), (np.cumsum(lengths) - lengths)[filled])
        peaks[filled] = np.where(np.isnan(found), np.float32(0), found)
    steps = (peaks.astype(np.float64) / STEPS).astype(np.float32)  # [sentences]
    scaled = np.repeat(steps, lengths)  # [tokens]: each token's step, then its value over it, in place
    with np.errstate(divide="ignore", invalid="ignore"):  # a step of 0 and NaN: set below
        np.divide(values, scaled, out=scaled)
        np.rint(scaled, out=scaled)
        np.clip(scaled, -STEPS, STEPS, out=scaled)
        codes = scaled.astype(np.int8)  # [tokens]
    if not steps.all():  # a sentence whose mined values are all 0: its codes 0
        codes[np.repeat(steps == 0, lengths)] = 0
    codes[np.isnan(values)] = NOT_MINED
    return steps, codes


def encode_layer_shading(shading: LayerShading) -> list[bytes]:
    """encode_shading's bytes of every key of a layer (byte for byte what it gives a key alone): the steps
    and codes of all the layer's sentences at once, then each key's deflated, on every core (zlib lets go
    of the interpreter while it compresses)."""
    steps, codes = _steps_and_codes(shading.values, np.diff(shading.offsets))  # [sentences], [tokens]
    firsts = shading.firsts  # [keys + 1]: each key's first sentence
    steps, codes = steps.tobytes(), codes.tobytes()
    size = np.dtype(np.float32).itemsize
    parts = [
        (steps[size * first : size * last], codes[shading.offsets[first] : shading.offsets[last]])
        for first, last in zip(firsts[:-1].tolist(), firsts[1:].tolist(), strict=True)
    ]  # [keys]: (steps, codes) bytes
    workers = os.cpu_count() or 1
    share = -(-len(parts) // workers)

    def deflate(start: int) -> list[bytes]:
        return [zlib.compress(step + code) for step, code in parts[start : start + share]]

    with ThreadPoolExecutor(workers) as pool:
        return [blob for blobs in pool.map(deflate, range(0, len(parts), share)) for blob in blobs]


def decode_shading(data: bytes, lengths: Sequence[int]) -> list[np.ndarray]:
    """The sentences' coefficients ([len] float32 each, NaN where not mined) from encode_shading's bytes."""
    steps, codes = _unpack(data, len(lengths))
    if len(codes) != sum(lengths):
        raise ValueError("the stored shading does not match these sentences")
    return _values(steps, codes, lengths)


def shading_codes(data: bytes, count: int) -> tuple[np.ndarray, np.ndarray]:
    """encode_shading's bytes of `count` sentences as (steps [count] float32, codes [tokens] int8): a value
    is its code times its sentence's step, NaN where the code is NOT_MINED (decode_shading)."""
    return _unpack(data, count)


def _unpack(data: bytes, count: int) -> tuple[np.ndarray, np.ndarray]:
    """encode_shading's bytes of `count` sentences as (steps [count] float32, codes [tokens] int8)."""
    data = zlib.decompress(data)
    steps = np.frombuffer(data, np.float32, count=count)  # [count]
    return steps, np.frombuffer(data, np.int8, offset=steps.nbytes)  # [tokens]


def _values(steps: np.ndarray, codes: np.ndarray, lengths: Sequence[int]) -> list[np.ndarray]:
    """Codes [sum(lengths)] times their sentence's step ([len(lengths)]), cut into sentences."""
    values = codes.astype(np.float32) * np.repeat(steps, lengths)  # [tokens]
    values[codes == NOT_MINED] = np.nan
    return np.split(values, np.cumsum(lengths)[:-1]) if len(lengths) else []


@dataclass(frozen=True)
class LayerShading:
    """One layer's shaded sentences, key after key: each key's first positive triggers, then its first
    negative triggers, then its band samples (samples_of's order). `values` [tokens] float32 (NaN where not
    mined) is cut into sentences by `offsets` [sentences + 1]; `counts` [keys, 3] is how many sentences of
    each kind a key has. One flat array, not an array a sentence: a 1B model shades millions."""

    values: np.ndarray
    offsets: np.ndarray
    counts: np.ndarray

    @cached_property
    def firsts(self) -> np.ndarray:
        """[keys + 1]: the index of each key's first sentence (and the count of all)."""
        return np.concatenate([[0], np.cumsum(self.counts.sum(axis=1))])

    def key(self, key: int) -> tuple[np.ndarray, np.ndarray]:
        """A key's values [its tokens] and sentence lengths [its sentences]: encode_shading's arguments."""
        bounds = self.offsets[self.firsts[key] : self.firsts[key + 1] + 1]  # [sentences + 1]
        return self.values[bounds[0] : bounds[-1]], np.diff(bounds)


def store_key_examples(
    *, session: Session, run_id: int, layer: int, mined: MinedLayer, shading: LayerShading
) -> int:
    """Store one layer's rows: per key its band samples (from `mined`) and the shading of its first
    positive and negative triggers and of each sample (encode_shading packs each key's part). Returns the
    shading's bytes."""
    bands = layer_bands(mined)
    positive, negative, samples = (column.tolist() for column in shading.counts.T)  # [keys] each
    if (mined.sample_sentence >= 0).sum(axis=(1, 2)).tolist() != samples:
        raise ValueError("the shading has not one sentence per band sample")
    shaded = encode_layer_shading(shading)
    quadrants = layer_quadrant_examples(mined) or repeat(None)
    rows = zip(
        repeat(run_id), repeat(int(layer)), range(len(bands)), bands, positive, negative, shaded, quadrants
    )
    columns = ("run_id", "layer", "key", "bands", "positive", "negative", "shading", "quadrants")
    bulk_insert(session, KeyExamples.__table__, columns, rows)
    return sum(map(len, shaded))


@dataclass(frozen=True)
class StoredExamples:
    """A key's stored examples: its band samples and the shading of the sentences they and its first
    `positive` / `negative` triggers are in (split with `shading`)."""

    samples: list[BandSample]
    positive: int
    negative: int
    data: bytes
    quadrants: list[QuadrantExample] | None = None  # a gated key's; None: ungated, or stored before 0022

    def shading(self, lengths: Sequence[int]) -> list[np.ndarray]:
        """The stored arrays cut at these sentence lengths (positive triggers', negative's, samples')."""
        if len(lengths) != self.positive + self.negative + len(self.samples):
            raise ValueError("the stored shading does not match these sentences")
        return decode_shading(self.data, lengths)

    def trigger_shading(self, lengths: Sequence[int]) -> list[np.ndarray]:
        """The shaded triggers' arrays (the first `positive` + `negative` stored), cut at these lengths."""
        return self._part(lengths, triggers=True)

    def sample_shading(self, lengths: Sequence[int]) -> list[np.ndarray]:
        """The band samples' arrays (the last ones stored), cut at these lengths."""
        return self._part(lengths, triggers=False)

    def _part(self, lengths: Sequence[int], *, triggers: bool) -> list[np.ndarray]:
        """The triggers' or the samples' arrays alone: a page decodes no more than it shows."""
        shaded = self.positive + self.negative
        steps, codes = _unpack(self.data, shaded + len(self.samples))
        tokens = sum(lengths)
        if len(lengths) != (shaded if triggers else len(self.samples)) or tokens > len(codes):
            raise ValueError("the stored shading does not match these sentences")
        if triggers:
            return _values(steps[:shaded], codes[:tokens], lengths)
        return _values(steps[shaded:], codes[len(codes) - tokens :], lengths)

    def steps(self) -> np.ndarray:
        """[sentences] float32: each shaded sentence's step; a stored value is within half of it."""
        return _unpack(self.data, self.positive + self.negative + len(self.samples))[0]


def key_examples(*, session: Session, run_id: int, layer: int, key: int) -> StoredExamples | None:
    """A finished run's stored examples of one key; None when it stored none (runs before 0011)."""
    row = session.scalars(
        select(KeyExamples).where(
            KeyExamples.run_id == run_id, KeyExamples.layer == layer, KeyExamples.key == key
        )
    ).first()
    if row is None:
        return None
    return StoredExamples(
        samples=decode_bands(row.bands),
        positive=row.positive,
        negative=row.negative,
        data=row.shading,
        quadrants=None if row.quadrants is None else decode_quadrant_examples(row.quadrants),
    )


def layer_shading(
    *, session: Session, run_id: int, layer: int, quadrants: bool = False
) -> dict[int, StoredExamples]:
    """A finished run's stored examples of every key of a layer, by key, with a gated key's quadrant
    examples where `quadrants` asks (the explanations fit on them: ffmem.worker.explanations); none for
    runs before 0011."""
    query = select(
        KeyExamples.key,
        KeyExamples.bands,
        KeyExamples.positive,
        KeyExamples.negative,
        KeyExamples.shading,
        KeyExamples.quadrants if quadrants else null(),
    ).where(KeyExamples.run_id == run_id, KeyExamples.layer == layer)
    return {
        key: StoredExamples(
            samples=decode_bands(bands),
            positive=positive,
            negative=negative,
            data=shading,
            quadrants=None if examples is None else decode_quadrant_examples(examples),
        )
        for key, bands, positive, negative, shading, examples in session.execute(query)
    }
