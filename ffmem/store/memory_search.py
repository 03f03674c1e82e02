"""Keyword-only reads and writes for the two ways of finding memories that are not in `memory_reads`:
full-vocabulary token search (a run's token → memories table, ffmem.engine.values.token_memories) and each
memory's nearest memories by key and value direction with the random-pair baseline that says what near
is (ffmem.engine.relations.neighbours). No torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

import numpy as np
from sqlalchemy import delete, exists, insert, select
from sqlalchemy.orm import Session

from ffmem.store import memory_lists
from ffmem.store.bulk import bulk_insert
from ffmem.store.memory_lists import SCORED_MEMORY
from ffmem.store.models import NeighbourBaseline, Neighbours, TokenMemoryList

NEIGHBOUR_KINDS = ("key", "value")
COSINE_DIGITS = 6  # a neighbour's cosine as read, and the nearest-neighbour baseline as stored


# ---- the token → memories table --------------------------------------------------------------------


def store_token_memories(
    *, session: Session, run_id: int, readout: str, memories: np.ndarray, scores: np.ndarray
) -> int:
    """Store one readout's token → memories table (memories and scores [vocab, lists, depth], row t the
    token t; ffmem.engine.values.token_memories), replacing the readout's rows; returns the tokens stored."""
    if readout not in memory_lists.READOUTS:
        raise ValueError(f"unknown readout {readout!r}; choose from {memory_lists.READOUTS}")
    table = TokenMemoryList.__table__
    session.execute(delete(table).where(table.c.run_id == run_id, table.c.readout == readout))
    blobs = memory_lists.encode_token_memories(memories, scores)
    fixed = {"run_id": run_id, "readout": readout}
    bulk_insert(session, table, ("token_id", "data"), zip(range(len(blobs)), blobs, strict=True), fixed=fixed)
    return len(blobs)


def has_token_memories(*, session: Session, run_id: int, readout: str) -> bool:
    """Whether the run has the table for `readout` (runs stored before revision 0018 have none)."""
    where = (TokenMemoryList.run_id == run_id, TokenMemoryList.readout == readout)
    return bool(session.scalar(select(exists().where(*where))))


def token_memories(
    *, session: Session, run_id: int, readout: str, token_ids: Sequence[int]
) -> dict[int, np.ndarray]:
    """token id → its lists under `readout` ([lists, depth] TOKEN_MEMORY records, memory_lists.TOKEN_LISTS
    order); a token the table lacks (past the model's vocabulary) is left out."""
    rows = session.execute(
        select(TokenMemoryList.token_id, TokenMemoryList.data).where(
            TokenMemoryList.run_id == run_id,
            TokenMemoryList.readout == readout,
            TokenMemoryList.token_id.in_(sorted({int(t) for t in token_ids})),
        )
    )
    return {token_id: memory_lists.decode_token_memories(data) for token_id, data in rows}


# ---- neighbours -----------------------------------------------------------------------------------


def store_neighbours(
    *,
    session: Session,
    run_id: int,
    n_keys: int,
    neighbours: dict[str, tuple[np.ndarray, np.ndarray]],
    baselines: dict[str, Sequence[tuple[int, float, float]]] | None = None,
    nearest: dict[str, np.ndarray] | None = None,
) -> int:
    """Store each memory's nearest memories, replacing any the run had: `neighbours[kind]` is (indices,
    cosines), each [layers · keys, k], indices layer-major (layer · n_keys + key); `baselines[kind]`, per
    layer (pairs, mean, p99) of random pairs' |cosine| (ffmem.engine.relations.neighbours.Baseline);
    `nearest[kind]` [layers, k], per layer the median cosine of its memories' r-th nearest neighbour
    (ffmem.engine.relations.neighbours.nearest_baseline), stored with the layer's baseline rounded as the
    cosines are read (`get_neighbours`). Returns rows stored (one a memory, both kinds in it)."""
    if unknown := (set(neighbours) | set(baselines or {}) | set(nearest or {})) - set(NEIGHBOUR_KINDS):
        raise ValueError(f"unknown neighbour kind {sorted(unknown)[0]!r}; choose from {NEIGHBOUR_KINDS}")
    session.execute(delete(Neighbours).where(Neighbours.run_id == run_id))
    session.execute(delete(NeighbourBaseline).where(NeighbourBaseline.run_id == run_id))
    for kind, layers in (baselines or {}).items():
        medians = (nearest or {}).get(kind)
        rows = [
            dict(
                run_id=run_id,
                layer=layer,
                kind=kind,
                pairs=int(pairs),
                mean=float(mean),
                p99=float(p99),
                nearest=None if medians is None else [round(float(c), COSINE_DIGITS) for c in medians[layer]],
            )
            for layer, (pairs, mean, p99) in enumerate(layers)
        ]
        if rows:
            session.execute(insert(NeighbourBaseline), rows)
    packed = {}
    for kind, (indices, cosines) in neighbours.items():
        packed[kind] = np.empty(np.shape(indices), SCORED_MEMORY)  # [layers · keys, k]
        packed[kind]["layer"], packed[kind]["key"] = np.divmod(np.asarray(indices, dtype=np.int64), n_keys)
        packed[kind]["score"] = cosines
    memories = max((len(p) for p in packed.values()), default=0)
    layers, keys = divmod(np.arange(memories), n_keys)  # [memories] each
    blobs = [_records(packed.get(kind), memories) for kind in NEIGHBOUR_KINDS]
    rows = zip(layers.tolist(), keys.tolist(), *blobs, strict=True)
    columns = ("layer", "key", "by_key", "by_value")
    bulk_insert(session, Neighbours.__table__, columns, rows, fixed={"run_id": run_id})
    return memories


def _records(packed: np.ndarray | None, memories: int) -> list[bytes] | repeat:
    """Each memory's packed neighbours of one kind; None where the kind was not computed."""
    if packed is None:
        return repeat(None, memories)
    return memory_lists.row_bytes(b"", packed.view(np.uint8).reshape(len(packed), -1))


def get_neighbour_baselines(*, session: Session, run_id: int, layer: int) -> dict[str, NeighbourBaseline]:
    """kind ("key", "value") → the layer's random-pair baseline; {} for a run stored before them."""
    query = select(NeighbourBaseline).where(
        NeighbourBaseline.run_id == run_id, NeighbourBaseline.layer == layer
    )
    return {row.kind: row for row in session.scalars(query)}


def get_neighbours(*, session: Session, run_id: int, layer: int, key: int) -> dict[str, list[list[float]]]:
    """kind ("key", "value") → [[layer, key, cosine], …] of one memory, the highest first; {} when the
    run has none (stored before migration 0008, or still mining)."""
    row = session.execute(
        select(Neighbours.by_key, Neighbours.by_value).where(
            Neighbours.run_id == run_id, Neighbours.layer == layer, Neighbours.key == key
        )
    ).first()
    return {
        kind: [[lay, k, round(c, COSINE_DIGITS)] for lay, k, c in np.frombuffer(data, SCORED_MEMORY).tolist()]
        for kind, data in zip(NEIGHBOUR_KINDS, row or (), strict=False)
        if data is not None
    }
