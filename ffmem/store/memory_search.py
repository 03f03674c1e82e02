"""Keyword-only reads and writes for the two ways of finding memories that are not in `memory_reads`:
full-vocabulary token search (a run's arrays, ffmem.engine.vocab_search) and each memory's nearest
memories by key and value direction with the random-pair baseline that says what near is
(ffmem.engine.neighbours). No torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from sqlalchemy import delete, exists, insert, select
from sqlalchemy.orm import Session

from ffmem.engine.vocab_search import BLOCK, SearchArrays, from_npy, to_npy
from ffmem.store import memory_reads
from ffmem.store.bulk import bulk_insert
from ffmem.store.memory_lists import SCORED_MEMORY
from ffmem.store.models import NeighbourBaseline, Neighbours, RunArray

NEIGHBOUR_KINDS = ("key", "value")


# ---- token search arrays --------------------------------------------------------------------------


def store_run_arrays(*, session: Session, run_id: int, arrays: Iterable[tuple[str, int, np.ndarray]]) -> int:
    """Store a run's token-search arrays as (name, part, array), replacing any it had; returns the bytes
    stored."""
    session.execute(delete(RunArray).where(RunArray.run_id == run_id))
    stored = 0
    for name, part, array in arrays:
        data = to_npy(array)
        session.execute(insert(RunArray).values(run_id=run_id, name=name, part=int(part), data=data))
        stored += len(data)
    return stored


def has_run_arrays(*, session: Session, run_id: int) -> bool:
    """Whether the run has token-search arrays (runs stored before migration 0008 have none)."""
    where = (RunArray.run_id == run_id, RunArray.name == "value_stats")
    return bool(session.scalar(select(exists().where(*where))))


def load_search_arrays(*, session: Session, run_id: int) -> SearchArrays | None:
    """A run's value matrix and readout terms (not the output embedding: `embedding_rows`), or None."""
    rows = session.execute(
        select(RunArray.name, RunArray.part, RunArray.data)
        .where(RunArray.run_id == run_id, RunArray.name != "unembedding")
        .order_by(RunArray.name, RunArray.part)
    ).all()
    values = [from_npy(row.data) for row in rows if row.name == "values"]
    singles = {row.name: from_npy(row.data) for row in rows if row.name != "values"}
    if not values or "value_stats" not in singles:
        return None
    return SearchArrays.from_parts(values, singles)


def embedding_rows(
    *, session: Session, run_id: int, token_ids: Sequence[int]
) -> tuple[list[int], np.ndarray]:
    """(the ids found, their rows of the run's output embedding E: [found, d] float32), reading only the
    stored blocks that hold them; an id past E's rows (a tokenizer's added token) is left out."""
    parts = sorted({int(t) // BLOCK for t in token_ids})
    rows = session.execute(
        select(RunArray.part, RunArray.data).where(
            RunArray.run_id == run_id, RunArray.name == "unembedding", RunArray.part.in_(parts)
        )
    ).all()
    blocks = {row.part: from_npy(row.data) for row in rows}
    found = [int(t) for t in token_ids if int(t) % BLOCK < len(blocks.get(int(t) // BLOCK, ()))]
    d = next(iter(blocks.values())).shape[1] if blocks else 0
    embedding = [blocks[t // BLOCK][t % BLOCK] for t in found]
    return found, np.stack(embedding).astype(np.float32) if found else np.zeros((0, d), dtype=np.float32)


def stored_ranks(
    *,
    session: Session,
    run_id: int,
    readout: str,
    token_ids: Sequence[int],
    memories: Sequence[tuple[int, int]],
) -> dict[tuple[int, int, int, int], int]:
    """(layer, key, token id, direction) → rank, for the `token_ids` among the stored top (+1) or bottom
    (−1) value tokens of `memories` ((layer, key) pairs): the exact rank, counted from that end."""
    if not token_ids or not memories:
        return {}
    wanted = {int(t) for t in token_ids}
    listed = memory_reads.memory_value_tokens(
        session=session,
        run_id=run_id,
        readout=readout,
        memories={(int(layer), int(key), d) for layer, key in memories for d in (1, -1)},
        n=None,
    )
    return {
        (layer, key, token_id, direction): rank
        for (layer, key, direction), ids in listed.items()
        for rank, token_id in enumerate(ids)
        if token_id in wanted
    }


# ---- neighbours -----------------------------------------------------------------------------------


def store_neighbours(
    *,
    session: Session,
    run_id: int,
    n_keys: int,
    neighbours: dict[str, tuple[np.ndarray, np.ndarray]],
    baselines: dict[str, Sequence[tuple[int, float, float]]] | None = None,
) -> int:
    """Store each memory's nearest memories, replacing any the run had: `neighbours[kind]` is (indices,
    cosines), each [layers · keys, k], indices layer-major (layer · n_keys + key); `baselines[kind]`, per
    layer (pairs, mean, p99) of random pairs' |cosine| (ffmem.engine.neighbours.Baseline). Returns rows
    stored."""
    session.execute(delete(Neighbours).where(Neighbours.run_id == run_id))
    session.execute(delete(NeighbourBaseline).where(NeighbourBaseline.run_id == run_id))
    for kind, layers in (baselines or {}).items():
        if kind not in NEIGHBOUR_KINDS:
            raise ValueError(f"unknown neighbour kind {kind!r}; choose from {NEIGHBOUR_KINDS}")
        rows = [
            dict(run_id=run_id, layer=layer, kind=kind, pairs=int(pairs), mean=float(mean), p99=float(p99))
            for layer, (pairs, mean, p99) in enumerate(layers)
        ]
        if rows:
            session.execute(insert(NeighbourBaseline), rows)
    stored = 0
    for kind, (indices, cosines) in neighbours.items():
        if kind not in NEIGHBOUR_KINDS:
            raise ValueError(f"unknown neighbour kind {kind!r}; choose from {NEIGHBOUR_KINDS}")
        packed = np.empty(np.shape(indices), SCORED_MEMORY)  # [layers · keys, k]
        packed["layer"], packed["key"] = np.divmod(np.asarray(indices, dtype=np.int64), n_keys)
        packed["score"] = cosines
        rows = (
            (run_id, memory // n_keys, memory % n_keys, kind, packed[memory].tobytes())
            for memory in range(packed.shape[0])
        )
        bulk_insert(session, Neighbours.__table__, ("run_id", "layer", "key", "kind", "data"), rows)
        stored += indices.shape[0]
    return stored


def get_neighbour_baselines(*, session: Session, run_id: int, layer: int) -> dict[str, NeighbourBaseline]:
    """kind ("key", "value") → the layer's random-pair baseline; {} for a run stored before them."""
    query = select(NeighbourBaseline).where(
        NeighbourBaseline.run_id == run_id, NeighbourBaseline.layer == layer
    )
    return {row.kind: row for row in session.scalars(query)}


def get_neighbours(*, session: Session, run_id: int, layer: int, key: int) -> dict[str, list[list[float]]]:
    """kind ("key", "value") → [[layer, key, cosine], …] of one memory, the highest first; {} when the
    run has none (stored before migration 0008, or still mining)."""
    rows = session.execute(
        select(Neighbours.kind, Neighbours.data).where(
            Neighbours.run_id == run_id, Neighbours.layer == layer, Neighbours.key == key
        )
    ).all()
    return {
        kind: [[lay, k, round(c, 6)] for lay, k, c in np.frombuffer(data, SCORED_MEMORY).tolist()]
        for kind, data in rows
    }
