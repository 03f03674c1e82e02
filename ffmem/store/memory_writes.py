"""The index build's writes of a run's memories: each layer's triggers and value tokens as packed lists
(ffmem.store.memory_lists), its key statistics, and the run's positive triggers by sentence. Called by
the worker's storing stage; the explorer reads them through ffmem.store.memory_reads.

Bulk writes go through `ffmem.store.bulk.bulk_insert`: COPY on Postgres, a driver-level executemany per
chunk on SQLite, always inside the session's transaction.
"""

from __future__ import annotations

import math
from itertools import compress, repeat

import numpy as np
from sqlalchemy.orm import Session

from ffmem.store import layer_table, memory_lists
from ffmem.store.bulk import bulk_insert
from ffmem.store.db import json_dumps
from ffmem.store.memory_lists import TRIGGERS
from ffmem.store.models import QUADRANT_COLUMNS, KeyStats, MemoryList, SentenceTriggers


def store_triggers(
    *,
    session: Session,
    run_id: int,
    layer: int,
    sign: int,
    coefficients: np.ndarray,
    sentence_index: np.ndarray,
    position: np.ndarray,
) -> int:
    """Store one layer's top-T triggers of one sign ([n_keys, T] arrays, rank = column), one packed list
    per key; returns the triggers stored. Entries with sentence_index -1 (fewer sentences than T) are
    skipped; a key with none stores no list."""
    sentence_index, position, coefficients = same_shape(
        2, sentence_index=sentence_index, position=position, coefficients=coefficients
    )
    blobs = memory_lists.encode_triggers(sentence_index, position, coefficients)
    kept = (sentence_index >= 0).any(axis=1)  # [keys]: a key with no trigger stores no list
    if kept.all():
        rows = zip(range(len(blobs)), blobs, strict=True)
    else:
        rows = zip(np.flatnonzero(kept).tolist(), compress(blobs, kept), strict=True)
    _store_lists(session, run_id, TRIGGERS, sign, layer, rows)
    return int((sentence_index >= 0).sum())


LIST_COLUMNS = ("run_id", "kind", "sign", "layer", "key", "data")


def _store_lists(session: Session, run_id: int, kind: str, sign: int, layer: int, rows) -> None:
    """One layer's lists of a kind and sign: rows of (key, blob)."""
    fixed = {"run_id": run_id, "kind": kind, "sign": int(sign), "layer": int(layer)}
    bulk_insert(session, MemoryList.__table__, ("key", "data"), rows, fixed=fixed)


def store_value_tokens(
    *,
    session: Session,
    run_id: int,
    layer: int,
    readout: str,
    direction: int,
    token_ids: np.ndarray,
    logits: np.ndarray,
    log_z: np.ndarray,
) -> int:
    """Store one layer's top (+1) or bottom (-1) value tokens under one readout (token ids and logits
    [n_keys, n], and log_z [n_keys], each value's log-sum-exp over the full readout), one packed list
    per key; returns the tokens stored."""
    if readout not in memory_lists.READOUTS:
        raise ValueError(f"unknown readout {readout!r}; choose from {memory_lists.READOUTS}")
    token_ids, logits = same_shape(2, token_ids=token_ids, logits=logits)
    log_z = np.asarray(log_z).reshape(-1)  # [n_keys]
    if log_z.shape[0] != token_ids.shape[0]:
        raise ValueError(f"log_z has {log_z.shape[0]} values for {token_ids.shape[0]} keys")
    blobs = memory_lists.encode_value_tokens(token_ids, logits, log_z)
    rows = zip(range(len(blobs)), blobs, strict=True)
    _store_lists(session, run_id, readout, direction, layer, rows)
    return token_ids.size


def _quadrant_columns(shares: np.ndarray | None, n_keys: int) -> list[list]:
    """The quadrant shares as columns [4 × keys] and the dominant quadrant's [keys] (NULL: ungated)."""
    if shares is None:
        return [[None] * n_keys] * (len(QUADRANT_COLUMNS) + 1)
    shares = np.asarray(shares, dtype=float)
    if shares.shape != (n_keys, len(QUADRANT_COLUMNS)):
        raise ValueError(f"quadrant_shares has shape {shares.shape}; expected [{n_keys}, 4]")
    return [*shares.T.tolist(), shares.argmax(axis=1).tolist()]


def store_key_stats(
    *,
    session: Session,
    run_id: int,
    layer: int,
    mean: np.ndarray,
    positive_share: np.ndarray,
    max_coefficient: np.ndarray,
    min_coefficient: np.ndarray,
    value_norm: np.ndarray,
    histogram: np.ndarray,
    density: np.ndarray,
    max_prob: np.ndarray,
    agreement: np.ndarray,
    next_token_rank: np.ndarray,
    quadrant_shares: np.ndarray | None = None,
) -> None:
    """Store one layer's key statistics ([n_keys]; histogram [n_keys, n_bins]; a gated layer's
    quadrant_shares [n_keys, 4], with the largest's number as the dominant quadrant).

    NaN or ±inf max/min → NULL; a next-token rank of −1 (no token after the top trigger) → NULL.
    """
    arrays = same_shape(
        1,
        mean=mean,
        positive_share=positive_share,
        max_coefficient=max_coefficient,
        min_coefficient=min_coefficient,
        value_norm=value_norm,
        density=density,
        max_prob=max_prob,
        agreement=agreement,
        next_token_rank=next_token_rank,
    )
    mean, positive_share, max_coefficient, min_coefficient, value_norm = arrays[:5]
    density, max_prob, agreement, next_token_rank = arrays[5:]
    histogram = np.asarray(histogram)
    if histogram.ndim != 2 or histogram.shape[0] != mean.shape[0]:
        raise ValueError(f"histogram has shape {histogram.shape}; expected [{mean.shape[0]}, n_bins]")
    rows = zip(
        range(mean.shape[0]),
        mean.tolist(),
        positive_share.tolist(),
        map(_finite_or_none, max_coefficient.tolist()),
        map(_finite_or_none, min_coefficient.tolist()),
        value_norm.tolist(),
        json_rows(histogram),
        density.tolist(),
        max_prob.tolist(),
        agreement.astype(int).tolist(),
        [None if rank < 0 else rank for rank in next_token_rank.astype(int).tolist()],
        *_quadrant_columns(quadrant_shares, mean.shape[0]),
        strict=True,
    )
    columns = (
        "key",
        "mean",
        "positive_share",
        "max_coefficient",
        "min_coefficient",
        "value_norm",
        "histogram",
        "density",
        "max_prob",
        "agreement",
        "next_token_rank",
        *QUADRANT_COLUMNS,
        "dominant_quadrant",
    )
    fixed = {"run_id": run_id, "layer": int(layer)}
    bulk_insert(session, KeyStats.__table__, columns, rows, fixed=fixed, json_text=("histogram",))
    as_stored = {
        "max_coefficient": max_coefficient,
        "min_coefficient": min_coefficient,
        "positive_share": positive_share,
        "density": density,
        "agreement": agreement.astype(int),
        "max_prob": max_prob,
        "next_token_rank": np.where(next_token_rank.astype(int) < 0, np.nan, next_token_rank),
        "value_norm": value_norm,
    }
    # As the database holds them: SQLite every REAL in 8 bytes, Postgres a statistic in 4 (models.Float32).
    stored = np.float64 if session.connection().dialect.name == "sqlite" else np.float32
    as_stored = {name: np.asarray(values, stored) for name, values in as_stored.items()}  # [keys] each
    quadrants = _quadrant_columns(quadrant_shares, mean.shape[0])
    for name, values in zip((*QUADRANT_COLUMNS, "dominant_quadrant"), quadrants, strict=True):
        as_stored[name] = np.array(values, stored)  # [keys]; None → NaN
    layer_table.store_key_orders(session=session, run_id=run_id, layer=layer, statistics=as_stored)


def json_rows(array: np.ndarray) -> list[str]:
    """Each row of a 2-d numeric array as db.json_dumps writes its list, the array encoded at once and cut
    at its rows' brackets (numbers hold none)."""
    if len(array) == 0:
        return []
    return ["[" + row + "]" for row in json_dumps(np.asarray(array).tolist())[2:-2].split("],[")]


def same_shape(ndim: int, **arrays: np.ndarray) -> list[np.ndarray]:
    """The arrays as numpy arrays, checked to share one shape of `ndim` dimensions (named in the error)."""
    arrays = {name: np.asarray(array) for name, array in arrays.items()}
    shapes = {name: array.shape for name, array in arrays.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != ndim:
        raise ValueError(f"arrays must share one {ndim}-d shape, got {shapes}")
    return list(arrays.values())


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def store_sentence_triggers(
    *,
    session: Session,
    run_id: int,
    memory: np.ndarray,
    sentence_index: np.ndarray,
    position: np.ndarray,
    coefficient: np.ndarray,
) -> int:
    """Store the run's positive triggers grouped by sentence (flat [triggers] arrays: memory number layer ·
    keys + key, sentence index, position, coefficient; −1 sentences skipped), one row per sentence;
    returns the sentences stored."""
    sentences, blobs = memory_lists.encode_sentence_triggers(memory, sentence_index, position, coefficient)
    rows = zip(repeat(run_id), sentences, blobs)
    bulk_insert(session, SentenceTriggers.__table__, ("run_id", "sentence_index", "data"), rows)
    return len(sentences)
