"""A memory's ranked lists packed as bytes (the `memory_lists` table, one row per run, kind, sign, layer and
key; numpy, no torch, no SQL): its top-T triggers of one sign, and its value's top (sign +1) or bottom
(−1) tokens under one readout.

    kind "triggers"     entries of TRIGGER (10 B): sentence index int32, position int16, coefficient
                        float32, strongest first (rank = place in the list)
    kind "raw", "norm"  a VALUE_HEADER (5 B): the token ids' width in bytes (2: uint16 when every id of the
                        stored layer fits, else 4: int32) and log_z, the log-sum-exp of the value's full
                        readout; then entries of value_entry(width): token id, logit float32, by rank.
                        A token's probability is exp(logit − log_z), the softmax over the vocabulary.

A vocabulary token's memories (the `token_memories` table, one row per run, readout and token; ffmem.engine.
token_memories builds them): its lists of TOKEN_LISTS, each of `depth` entries of TOKEN_MEMORY (8 B): the
memory (layer · keys + key, int32; −1: none, where the model has fewer memories than `depth`) and its
score (float32: the token's logit, or its log-probability logit − log_z, in the value's readout), best first.

A sentence's triggers (the `sentence_triggers` table, one row per run and sentence): every positive trigger
of the run in that sentence, as SENTENCE_TRIGGER records (10 B): the memory (layer · keys + key, int32),
the trigger's position (int16) and its coefficient (float32), by memory.

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


def value_entry(token_bytes: int) -> np.dtype:
    """One value token as stored: its id (uint16 or int32) and logit (float32)."""
    return np.dtype([("token_id", "<u2" if token_bytes == 2 else "<i4"), ("logit", "<f4")])


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
    """One blob per key from [keys, T] arrays (rank = column); entries with sentence index −1 (fewer
    sentences than T) are left out."""
    packed = np.empty(sentence_index.shape, TRIGGER)  # [keys, T]
    packed["sentence_index"], packed["position"], packed["coefficient"] = (
        sentence_index,
        position,
        coefficient,
    )
    kept = sentence_index >= 0  # [keys, T]
    if kept.all():
        return [row.tobytes() for row in packed]
    return [row[keep].tobytes() for row, keep in zip(packed, kept, strict=True)]


def decode_triggers(data: bytes) -> np.ndarray:
    """A blob's triggers: [T] records of TRIGGER, strongest first."""
    return np.frombuffer(data, TRIGGER)


def token_bytes(token_ids: np.ndarray) -> int:
    """2 when every id fits uint16 (vocabularies up to 65,536 tokens), else 4."""
    return 2 if token_ids.size == 0 or int(token_ids.max()) < 2**16 else 4


def encode_value_tokens(token_ids: np.ndarray, logits: np.ndarray, log_z: np.ndarray) -> list[bytes]:
    """One blob per key from token ids and logits [keys, n] and log_z [keys]."""
    width = token_bytes(token_ids)
    header = np.empty((len(log_z), 1), VALUE_HEADER)  # [keys, 1]
    header["token_bytes"], header["log_z"] = width, np.asarray(log_z).reshape(-1, 1)
    entries = np.empty(token_ids.shape, value_entry(width))  # [keys, n]
    entries["token_id"], entries["logit"] = token_ids, logits
    return [h.tobytes() + e.tobytes() for h, e in zip(header, entries, strict=True)]


def decode_value_tokens(data: bytes) -> tuple[np.ndarray, float]:
    """A blob's (entries, log_z): [n] records of value_entry (token_id, logit), by rank."""
    header = np.frombuffer(data, VALUE_HEADER, count=1)[0]
    entries = np.frombuffer(data, value_entry(int(header["token_bytes"])), offset=VALUE_HEADER.itemsize)
    return entries, float(header["log_z"])


def encode_sentence_triggers(
    memory: np.ndarray, sentence_index: np.ndarray, position: np.ndarray, coefficient: np.ndarray
) -> tuple[list[int], list[bytes]]:
    """(sentence indices, one blob each) from triggers as flat [triggers] arrays, any order; a blob's
    entries by memory (then position). Entries with sentence index −1 (empty slots) are left out."""
    real = sentence_index >= 0
    memory, sentence_index, position, coefficient = (
        a[real] for a in (memory, sentence_index, position, coefficient)
    )
    order = np.lexsort((position, memory, sentence_index))  # [triggers]: by sentence, then memory
    packed = np.empty(len(order), SENTENCE_TRIGGER)  # [triggers]
    packed["memory"], packed["position"], packed["coefficient"] = (
        memory[order],
        position[order],
        coefficient[order],
    )
    sentences, starts = np.unique(sentence_index[order], return_index=True)  # [sentences] each
    return sentences.tolist(), [part.tobytes() for part in np.split(packed, starts[1:])]


def decode_sentence_triggers(data: bytes) -> np.ndarray:
    """A blob's triggers: [n] SENTENCE_TRIGGER records, by memory."""
    return np.frombuffer(data, SENTENCE_TRIGGER)


def encode_token_memories(memories: np.ndarray, scores: np.ndarray) -> list[bytes]:
    """One blob per token from memories and scores [vocab, lists, depth]."""
    entries = np.empty(memories.shape, TOKEN_MEMORY)  # [vocab, lists, depth]
    entries["memory"], entries["score"] = memories, scores
    return [row.tobytes() for row in entries]


def decode_token_memories(data: bytes) -> np.ndarray:
    """A blob's lists: [lists, depth] records of TOKEN_MEMORY, in TOKEN_LISTS order."""
    return np.frombuffer(data, TOKEN_MEMORY).reshape(len(TOKEN_LISTS), -1)


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
        counts = np.array([len(b) // TRIGGER.itemsize for b in blobs], np.int64)  # [memories]
        entries = np.frombuffer(b"".join(blobs), TRIGGER)  # [entries]
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
