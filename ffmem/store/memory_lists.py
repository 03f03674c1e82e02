"""A memory's ranked lists packed as bytes (the `memory_lists` table, one row per run, kind, sign, layer and
key; numpy, no torch, no SQL): its top-T triggers of one sign, and its value's top (sign +1) or bottom
(−1) tokens under one readout.

Integers are packed in as few bytes as the largest of their layer (or table) needs, 1 to 4, little-endian
(`int_width`, `pack_columns`): a blob starts with its integer columns' widths, one byte each, and is padded
to an odd length, so that the fixed-width blobs stored before revision 0031 (always of even length) still
read as they were written.

    kind "triggers"     a header (2 B: the widths of the sentence index and the position), then entries of
                        sentence index, position, coefficient float32, strongest first (rank = place in the
                        list): 7 B an entry for ≤ 65,535 sentences of ≤ 255 tokens, 8 B for ≤ 16.7 M
                        (before 0031: TRIGGER, 10 B, no header)
    kind "raw", "norm"  a VALUE_HEADER (5 B): the token ids' width in bytes (2 when every id of the stored
                        layer is < 65,536, 3 below 16,777,216, else 4) and log_z, the log-sum-exp of the
                        value's full readout; then entries of token id, logit float32, by rank.
                        A token's probability is exp(logit − log_z), the softmax over the vocabulary.

A vocabulary token's memories (the `token_memories` table, one row per run, readout and token; ffmem.engine.
token_memories builds them): a header (1 B: the memory's width), then its lists of TOKEN_LISTS, each of
`depth` entries of the memory (layer · keys + key; all ones: none, where the model has fewer memories than
`depth`) and its score (float32: the token's logit, or its log-probability logit − log_z, in the value's
readout), best first; read back as TOKEN_MEMORY records (memory −1: none). Before 0031: TOKEN_MEMORY
(8 B), no header.

A sentence's triggers (the `sentence_triggers` table, one row per run and sentence): a header (2 B: the
widths of the memory and the position), then every positive trigger of the run in that sentence: the
memory (layer · keys + key), the trigger's position and its coefficient (float32), by memory; read back as
SENTENCE_TRIGGER records. Before 0031: SENTENCE_TRIGGER (10 B), no header.

`Trigger` and `ValueToken` are the decoded entries the pages read (ffmem.store.memory_reads); the index
build writes the lists (ffmem.store.memory_writes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TRIGGERS = "triggers"
READOUTS = ("raw", "norm")  # the value kinds: v·Eᵀ (the paper's) and lm_head(final_norm(v))
KINDS = (TRIGGERS, *READOUTS)

TRIGGER = np.dtype([("sentence_index", "<i4"), ("position", "<i2"), ("coefficient", "<f4")])  # 10 B
VALUE_HEADER = np.dtype([("token_bytes", "u1"), ("log_z", "<f4")])  # 5 B
SENTENCE_TRIGGER = np.dtype([("memory", "<i4"), ("position", "<i2"), ("coefficient", "<f4")])  # 10 B
TOKEN_MEMORY = np.dtype([("memory", "<i4"), ("score", "<f4")])  # 8 B
# A token's lists, in stored order: (ranked by, direction); as ffmem.engine.values.token_memories.LISTS.
TOKEN_LISTS = (("logit", 1), ("logit", -1), ("prob", 1), ("prob", -1))
# Another memory and its score (a neighbour's cosine, a weight-graph link's score): 10 B.
SCORED_MEMORY = np.dtype([("layer", "<i2"), ("key", "<i4"), ("score", "<f4")])
FLOAT = 0  # a column's width code for float32 in pack_columns (integers: 1 to 4 bytes)


def int_width(values: np.ndarray, *, none: bool = False) -> int:
    """Bytes (1 to 4) that these non-negative integers need, unsigned; with `none`, the all-ones code of
    that width (−1, none) stays free above the largest."""
    top = (int(np.max(values)) if np.size(values) else 0) + (1 if none else 0)
    return next((width for width in (1, 2, 3) if top < 256**width), 4)


def pack_columns(columns: Sequence[np.ndarray], widths: Sequence[int]) -> np.ndarray:
    """The columns (one shape [...] each) as [..., entry bytes] uint8: each integer column little-endian in
    its width (two's complement: −1 is all ones), FLOAT columns as float32."""
    parts = []
    for values, width in zip(columns, widths, strict=True):
        if width == FLOAT:
            values = np.ascontiguousarray(values, "<f4")
            parts.append(values.reshape(*values.shape, 1).view(np.uint8))  # [..., 4]
        else:  # an integer's low 4 bytes (a width is ≤ 4) are those of its int32 cast: half int64's bytes
            values = np.asarray(values)
            wide = "<i8" if values.dtype.kind not in "biu" else "<i4"
            values = np.ascontiguousarray(values, wide)
            parts.append(values.reshape(*values.shape, 1).view(np.uint8)[..., :width])  # [..., width]
    return np.concatenate(parts, axis=-1)  # [..., entry bytes]


def row_bytes(header: bytes, entries: np.ndarray, *, odd: bool = False) -> list[bytes]:
    """Each row of `entries` [rows, ...] uint8 as bytes after `header`, in one pass (no Python loop over
    the rows); with `odd`, a zero byte after where that would be even (packed_blob's padding)."""
    rows = len(entries)
    entries = entries.reshape(rows, -1)  # [rows, entry bytes]
    size = len(header) + entries.shape[1]
    pad = 1 if odd and size % 2 == 0 else 0
    if size + pad == 0:
        return [b""] * rows
    table = np.zeros((rows, size + pad), np.uint8)  # [rows, bytes]
    table[:, : len(header)] = np.frombuffer(header, np.uint8)
    table[:, len(header) : size] = entries
    return table.view(np.dtype((np.void, size + pad))).ravel().tolist()


def unpack_columns(raw: np.ndarray, widths: Sequence[int], none: Sequence[bool]) -> list[np.ndarray]:
    """pack_columns' bytes [n, entry bytes] back as columns [n]: integers int64 (all ones → −1 where
    `none`), floats float32."""
    columns, at = [], 0
    for width, maybe_none in zip(widths, none, strict=True):
        if width == FLOAT:
            columns.append(np.ascontiguousarray(raw[:, at : at + 4]).view("<f4")[:, 0])  # [n]
            at += 4
            continue
        wide = np.zeros((len(raw), 8), np.uint8)  # [n, 8]
        wide[:, :width] = raw[:, at : at + width]
        values = wide.view("<i8")[:, 0]  # [n]
        if maybe_none:
            values[values == 256**width - 1] = -1
        columns.append(values)
        at += width
    return columns


def entry_bytes(widths: Sequence[int]) -> int:
    """Bytes of one entry of these column widths."""
    return sum(4 if width == FLOAT else width for width in widths)


def packed_blob(header: bytes, entries: np.ndarray | bytes) -> bytes:
    """A blob of the packed format: the header, the entries' bytes, and a zero byte when that is even."""
    data = header + (entries if isinstance(entries, bytes) else entries.tobytes())
    return data if len(data) % 2 else data + b"\0"


def is_packed(data: bytes) -> bool:
    """Whether a blob has the packed format (odd length) rather than the fixed records before 0031."""
    return len(data) % 2 == 1


def unpacked(data: bytes, ints: int, floats: int) -> tuple[list[int], np.ndarray]:
    """A packed blob's integer widths (its header: `ints` bytes) and its entries [n, entry bytes] uint8
    (integer columns first, then `floats` float32 columns), the padding left out."""
    widths = list(data[:ints])
    size = entry_bytes(widths) + 4 * floats
    count = (len(data) - ints) // size
    raw = np.frombuffer(data, np.uint8, count=count * size, offset=ints).reshape(count, size)
    return widths, raw


@dataclass(frozen=True)
class Trigger:
    """A trigger prefix: sentence `sentence_index` up to and including `position`.

    sign +1: the key's top-T sentences by maximum coefficient; sign −1: by minimum (most negative).
    """

    run_id: int
    layer: int
    key: int
    sign: int
    rank: int  # 0 = strongest
    sentence_index: int
    position: int
    coefficient: float


@dataclass(frozen=True)
class SentenceTrigger:
    """A positive trigger found by its sentence (free-text search): key (`layer`, `key`) peaks at
    `position` of sentence `sentence_index` with `coefficient`, one of its top-T sentences."""

    layer: int
    key: int
    sentence_index: int
    position: int
    coefficient: float


@dataclass(frozen=True)
class ValueToken:
    """One of a value's top (`direction` +1) or bottom (−1) tokens under one readout ("raw": v·Eᵀ, the
    paper's; "norm": lm_head(final_norm(v)), the model's own logit path). `prob` is the softmax over the
    full vocabulary."""

    run_id: int
    layer: int
    key: int
    readout: str
    direction: int
    rank: int
    token_id: int
    logit: float
    prob: float


# ---- encoding ------------------------------------------------------------------------------------


def encode_triggers(sentence_index: np.ndarray, position: np.ndarray, coefficient: np.ndarray) -> list[bytes]:
    """One blob per key from [keys, T] arrays (rank = column), its integers as wide as the layer's largest
    need; entries with sentence index −1 (fewer sentences than T) are left out, a key with none is b""."""
    kept = sentence_index >= 0  # [keys, T]
    widths = (int_width(sentence_index[kept]), int_width(position[kept]))
    header = bytes(widths)
    packed = pack_columns((sentence_index, position, coefficient), (*widths, FLOAT))  # [keys, T, entry]
    if kept.all():
        return row_bytes(header, packed, odd=True)
    return [
        packed_blob(header, row[keep]) if keep.any() else b"" for row, keep in zip(packed, kept, strict=True)
    ]


def records(data: bytes, dtype: np.dtype, none: Sequence[bool] | None = None) -> np.ndarray:
    """A blob's entries as `dtype` records (its integer fields first, then its float32 ones): a packed
    blob's unpacked (`none`: the fields whose all-ones code is −1), one of the fixed records stored before
    0031 as it is."""
    if not is_packed(data):
        return np.frombuffer(data, dtype)
    floats = sum(np.issubdtype(dtype[name], np.floating) for name in dtype.names)
    widths, raw = unpacked(data, len(dtype.names) - floats, floats)
    found = np.empty(len(raw), dtype)  # [entries]
    none = none or [False] * len(dtype.names)
    columns = unpack_columns(raw, (*widths, *[FLOAT] * floats), none)
    for name, column in zip(dtype.names, columns, strict=True):
        found[name] = column
    return found


def decode_triggers(data: bytes) -> np.ndarray:
    """A blob's triggers: [T] records of TRIGGER, strongest first."""
    return records(data, TRIGGER)


def trigger_count(data: bytes) -> int:
    """How many triggers a blob holds (without decoding them)."""
    if not is_packed(data):
        return len(data) // TRIGGER.itemsize
    return (len(data) - 2) // (entry_bytes(data[:2]) + 4)


def token_bytes(token_ids: np.ndarray) -> int:
    """2 when every id fits uint16 (vocabularies up to 65,536 tokens), 3 up to 16,777,216, else 4."""
    return max(2, int_width(token_ids))


def value_entry(token_bytes: int) -> np.dtype:
    """One value token as read back: its id (uint16, or int32 for the wider ids) and logit (float32); as
    stored when the width is 2 or 4."""
    return np.dtype([("token_id", "<u2" if token_bytes == 2 else "<i4"), ("logit", "<f4")])


def encode_value_tokens(token_ids: np.ndarray, logits: np.ndarray, log_z: np.ndarray) -> list[bytes]:
    """One blob per key from token ids and logits [keys, n] and log_z [keys]."""
    width = token_bytes(token_ids)
    header = np.empty((len(log_z), 1), VALUE_HEADER)  # [keys, 1]
    header["token_bytes"], header["log_z"] = width, np.asarray(log_z).reshape(-1, 1)
    entries = pack_columns((token_ids, logits), (width, FLOAT))  # [keys, n, width + 4]
    both = np.concatenate(
        [header.view(np.uint8).reshape(len(header), -1), entries.reshape(len(header), -1)], 1
    )
    return row_bytes(b"", both)  # [keys]: header, entries


def decode_value_tokens(data: bytes) -> tuple[np.ndarray, float]:
    """A blob's (entries, log_z): [n] records of value_entry (token_id, logit), by rank."""
    header = np.frombuffer(data, VALUE_HEADER, count=1)[0]
    width = int(header["token_bytes"])
    if width != 3:
        return np.frombuffer(data, value_entry(width), offset=VALUE_HEADER.itemsize), float(header["log_z"])
    raw = np.frombuffer(data, np.uint8, offset=VALUE_HEADER.itemsize).reshape(-1, width + 4)  # [n, 7]
    entries = np.empty(len(raw), value_entry(4))  # [n]
    entries["token_id"], entries["logit"] = unpack_columns(raw, (width, FLOAT), (False, False))
    return entries, float(header["log_z"])


def encode_sentence_triggers(
    memory: np.ndarray, sentence_index: np.ndarray, position: np.ndarray, coefficient: np.ndarray
) -> tuple[list[int], list[bytes]]:
    """(sentence indices, one blob each) from triggers as flat [triggers] arrays, any order; a blob's
    entries by memory (then position), its integers as wide as the run's largest need. Entries with
    sentence index −1 (empty slots) are left out."""
    real = sentence_index >= 0
    if not real.all():
        memory, sentence_index, position, coefficient = (
            a[real] for a in (memory, sentence_index, position, coefficient)
        )
    order = _by_sentence(sentence_index, memory, position)  # [triggers]: by sentence, then memory
    widths = (int_width(memory), int_width(position))
    packed = pack_columns(
        (memory[order], position[order], coefficient[order]), (*widths, FLOAT)
    )  # [triggers, entry]
    ordered = sentence_index[order]  # [triggers], ascending
    starts = np.flatnonzero(np.diff(ordered, prepend=-1))  # [sentences]: each one's first trigger
    sentences = ordered[starts]  # [sentences]
    header = bytes(widths)
    data = packed.tobytes()  # [triggers · entry]: each sentence's part a slice
    size = packed.shape[1] if packed.ndim == 2 else 0
    ends = np.append(starts[1:], len(packed))[: len(starts)] * size  # [sentences]
    pads = (b"", b"\0")  # packed_blob's: the header and entries in one copy, a zero byte where even
    return sentences.tolist(), [
        b"".join((header, data[a:b], pads[(len(header) + b - a + 1) % 2]))
        for a, b in zip((starts * size).tolist(), ends.tolist(), strict=True)
    ]


def _by_sentence(sentence: np.ndarray, memory: np.ndarray, position: np.ndarray) -> np.ndarray:
    """np.lexsort((position, memory, sentence)), its ties in input order too, by stable sorts (a radix sort
    of the sentences where every index fits 16 bits): with the memories in order (as the writers give
    them) and no memory twice in a sentence, the sentences' sort alone, checked; else first by one key of
    memory and position. A fifth to a third of lexsort's time on an 8B run's 23 million triggers."""
    if len(sentence) == 0 or memory.min() < 0 or position.min() < 0 or position.max() >= 2**16:
        return np.lexsort((position, memory, sentence))
    narrow = np.uint16 if 0 <= sentence.min() and sentence.max() < 2**16 else sentence.dtype
    if (memory[1:] >= memory[:-1]).all():
        order = np.argsort(sentence.astype(narrow), kind="stable")  # [triggers]: by sentence, then memory
        by, of = sentence[order], memory[order]  # [triggers] each
        if not ((by[1:] == by[:-1]) & (of[1:] == of[:-1])).any():  # no tie left to the position
            return order
    inner = memory.astype(np.int64) << 16 | position.astype(np.int64)  # [triggers]
    order = np.argsort(inner, kind="stable")  # [triggers]
    return order[np.argsort(sentence[order].astype(narrow), kind="stable")]


def decode_sentence_triggers(data: bytes) -> np.ndarray:
    """A blob's triggers: [n] SENTENCE_TRIGGER records, by memory."""
    return records(data, SENTENCE_TRIGGER)


def encode_token_memories(memories: np.ndarray, scores: np.ndarray) -> list[bytes]:
    """One blob per token from memories and scores [vocab, lists, depth] (memory −1: none), the memories
    as wide as the table's largest needs."""
    width = int_width(memories[memories >= 0], none=True)
    packed = pack_columns((memories, scores), (width, FLOAT))  # [vocab, lists, depth, width + 4]
    return row_bytes(bytes([width]), packed, odd=True)


def decode_token_memories(data: bytes) -> np.ndarray:
    """A blob's lists: [lists, depth] records of TOKEN_MEMORY, in TOKEN_LISTS order."""
    return records(data, TOKEN_MEMORY, none=(True, False)).reshape(len(TOKEN_LISTS), -1)


def probabilities(logits: np.ndarray, log_z: np.ndarray | float) -> np.ndarray:
    """exp(logit − log_z) in float64: the softmax probability of each token (same shape as `logits`)."""
    return np.exp(np.asarray(logits, np.float64) - np.asarray(log_z, np.float64))


# ---- decoding to rows ----------------------------------------------------------------------------


def triggers_of(
    data: bytes, *, run_id: int, layer: int, key: int, sign: int, limit: int | None = None
) -> list[Trigger]:
    """A blob's triggers as Trigger rows, strongest first (the first `limit` when given)."""
    entries = decode_triggers(data)[:limit]
    return [
        Trigger(run_id, layer, key, sign, rank, int(s), int(p), float(c))
        for rank, (s, p, c) in enumerate(entries.tolist())
    ]


def value_tokens_of(
    data: bytes, *, run_id: int, layer: int, key: int, readout: str, direction: int, limit: int | None = None
) -> list[ValueToken]:
    """A blob's value tokens as ValueToken rows, by rank (the first `limit` when given)."""
    entries, log_z = decode_value_tokens(data)
    entries = entries[:limit]
    probs = probabilities(entries["logit"], log_z).tolist()
    return [
        ValueToken(run_id, layer, key, readout, direction, rank, int(t), float(logit), prob)
        for rank, ((t, logit), prob) in enumerate(zip(entries.tolist(), probs, strict=True))
    ]


def value_readouts(
    lists: dict[tuple[str, int], bytes], *, run_id: int, layer: int, key: int
) -> dict[tuple[str, int], list[ValueToken]]:
    """A value's top (+1) and bottom (−1) tokens under each readout, rank order, from its lists
    (ffmem.store.memory_reads.key_lists): (readout, direction) → ValueTokens (empty when not stored)."""
    where = dict(run_id=run_id, layer=layer, key=key)
    return {
        (kind, sign): value_tokens_of(data, **where, readout=kind, direction=sign)
        if (data := lists.get((kind, sign)))
        else []
        for kind in READOUTS
        for sign in (1, -1)
    }


@dataclass(frozen=True)
class Lists:
    """Many memories' lists of one kind and sign, decoded at once: entry i belongs to memory
    (layer[i], key[i]) at `rank[i]`; `log_z` is per entry (value lists only)."""

    layer: np.ndarray  # [entries] int16
    key: np.ndarray  # [entries] int32
    rank: np.ndarray  # [entries] int16
    entries: np.ndarray  # [entries] records: TRIGGER, or value_entry's fields as int64 / float32
    log_z: np.ndarray | None  # [entries] float32, or None for triggers

    def take(self, indices: np.ndarray) -> Lists:
        """The entries at `indices` ([picked] int), in that order."""
        log_z = None if self.log_z is None else self.log_z[indices]
        return Lists(self.layer[indices], self.key[indices], self.rank[indices], self.entries[indices], log_z)


def decode_many(kind: str, layers: Sequence[int], keys: Sequence[int], blobs: Sequence[bytes]) -> Lists:
    """The lists of many memories of one kind (their blobs, with each one's layer and key) as one Lists."""
    if kind == TRIGGERS:
        decoded = [decode_triggers(b) for b in blobs]
        counts = np.array([len(d) for d in decoded], np.int64)  # [memories]
        entries = np.concatenate(decoded) if decoded else np.empty(0, TRIGGER)  # [entries]
        log_z = None
    else:
        parts = [decode_value_tokens(b) for b in blobs]
        counts = np.array([len(e) for e, _ in parts], np.int64)  # [memories]
        entries = np.empty(int(counts.sum()), [("token_id", "<i8"), ("logit", "<f4")])  # [entries]
        if parts:
            entries["token_id"] = np.concatenate([e["token_id"] for e, _ in parts])
            entries["logit"] = np.concatenate([e["logit"] for e, _ in parts])
        log_z = np.repeat(np.array([z for _, z in parts], np.float32), counts)  # [entries]
    starts = np.repeat(np.cumsum(counts) - counts, counts)  # [entries]
    rank = (np.arange(int(counts.sum())) - starts).astype(np.int16)  # [entries]
    layer = np.repeat(np.asarray(layers, np.int16), counts)  # [entries]
    key = np.repeat(np.asarray(keys, np.int32), counts)  # [entries]
    return Lists(layer, key, rank, entries, log_z)
