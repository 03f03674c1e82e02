"""The explorer's reads of a run's memories: a key's triggers and value tokens (decoded from their packed
lists, ffmem.store.memory_lists), its statistics, a layer's keys and summaries, and reads across a whole
run (free-text search over its triggers, token search over its values), which decode all its lists of
one kind once per process. The index build writes them (ffmem.store.memory_writes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat

import numpy as np
from sqlalchemy import Boolean, LargeBinary, Row, case, func, literal, or_, select, union_all
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.functions import FunctionElement

from ffmem.store import memory_lists
from ffmem.store.cache import ProcessCache, database_of
from ffmem.store.memory_lists import TRIGGERS, Lists, SentenceTrigger, Trigger, ValueToken
from ffmem.store.models import (
    QUADRANT_COLUMNS,
    Explanation,
    KeyStats,
    MemoryList,
    Run,
    RunStatus,
    SentenceTriggers,
)


def _list(session: Session, run_id: int, kind: str, sign: int, layer: int, key: int) -> bytes | None:
    """One memory's packed list, if stored."""
    return session.scalar(
        select(MemoryList.data).where(
            MemoryList.run_id == run_id,
            MemoryList.kind == kind,
            MemoryList.sign == sign,
            MemoryList.layer == layer,
            MemoryList.key == key,
        )
    )


def _layer_lists(session: Session, run_id: int, kind: str, sign: int, layer: int, keys=None) -> Lists:
    """The lists of one kind and sign of a layer's keys (all, or `keys`), decoded, by key then rank."""
    query = select(MemoryList.key, MemoryList.data).where(
        MemoryList.run_id == run_id,
        MemoryList.kind == kind,
        MemoryList.sign == sign,
        MemoryList.layer == layer,
    )
    if keys is not None:
        query = query.where(MemoryList.key.in_([int(k) for k in keys]))
    rows = session.execute(query.order_by(MemoryList.key)).all()
    return memory_lists.decode_many(kind, [layer] * len(rows), [r.key for r in rows], [r.data for r in rows])


def get_triggers(
    *, session: Session, run_id: int, layer: int, key: int, sign: int, limit: int | None = None
) -> list[Trigger]:
    """A key's triggers of one sign, strongest first (the first `limit` when given)."""
    data = _list(session, run_id, TRIGGERS, sign, layer, key)
    if data is None:
        return []
    return memory_lists.triggers_of(data, run_id=run_id, layer=layer, key=key, sign=sign, limit=limit)


def get_value_tokens(
    *, session: Session, run_id: int, layer: int, key: int, readout: str, direction: int
) -> list[ValueToken]:
    """A value's top (+1) or bottom (−1) tokens under one readout, rank order."""
    data = _list(session, run_id, readout, direction, layer, key)
    if data is None:
        return []
    where = dict(run_id=run_id, layer=layer, key=key, readout=readout, direction=direction)
    return memory_lists.value_tokens_of(data, **where)


def key_lists(
    *, session: Session, run_id: int, layer: int, key: int, kinds: Sequence[str] = memory_lists.KINDS
) -> dict[tuple[str, int], bytes]:
    """One memory's packed lists of these kinds, both signs, in one read: (kind, sign) → data."""
    query = select(MemoryList.kind, MemoryList.sign, MemoryList.data).where(
        MemoryList.run_id == run_id,
        MemoryList.kind.in_(kinds),
        MemoryList.sign.in_((1, -1)),  # named, so that the primary key's layer and key columns are used
        MemoryList.layer == layer,
        MemoryList.key == key,
    )
    return {(kind, sign): data for kind, sign, data in session.execute(query)}


def layer_value_tokens(
    *, session: Session, run_id: int, layer: int, readout: str, direction: int, n: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int64, probabilities float64), each [keys, n]: every value's stored top or bottom tokens
    of a layer (the first `n` of each, or all)."""
    found = _layer_lists(session, run_id, readout, direction, layer)
    keys = len(np.unique(found.key))
    if not keys:
        return np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float64)
    ids = found.entries["token_id"].astype(np.int64).reshape(keys, -1)  # [keys, n]
    probs = memory_lists.probabilities(found.entries["logit"], found.log_z).reshape(keys, -1)  # [keys, n]
    return ids[:, :n], probs[:, :n]


def layer_triggers(*, session: Session, run_id: int, layer: int, sign: int) -> Lists:
    """Every key's triggers of one sign of a layer, decoded: by key, each key's strongest first."""
    return _layer_lists(session, run_id, TRIGGERS, sign, layer)


def iter_triggers(*, session: Session, run_id: int) -> Iterator[Trigger]:
    """Every trigger of the run, by layer, key, sign (−1 first) and rank; streamed."""
    query = (
        select(MemoryList.layer, MemoryList.key, MemoryList.sign, MemoryList.data)
        .where(MemoryList.run_id == run_id, MemoryList.kind == TRIGGERS)
        .order_by(MemoryList.layer, MemoryList.key, MemoryList.sign)
    )
    for layer, key, sign, data in session.execute(query.execution_options(yield_per=1000)):
        yield from memory_lists.triggers_of(data, run_id=run_id, layer=layer, key=key, sign=sign)


def iter_value_tokens(*, session: Session, run_id: int) -> Iterator[ValueToken]:
    """Every value token of the run, by layer, key, readout ("norm" first), direction (−1 first) and
    rank; streamed."""
    query = (
        select(MemoryList.layer, MemoryList.key, MemoryList.kind, MemoryList.sign, MemoryList.data)
        .where(MemoryList.run_id == run_id, MemoryList.kind.in_(memory_lists.READOUTS))
        .order_by(MemoryList.layer, MemoryList.key, MemoryList.kind, MemoryList.sign)
    )
    for layer, key, readout, sign, data in session.execute(query.execution_options(yield_per=1000)):
        where = dict(run_id=run_id, layer=layer, key=key, readout=readout, direction=sign)
        yield from memory_lists.value_tokens_of(data, **where)


# A finished run's lists never change, so reads across all of its memories (the stored-token search of a
# run from before revision 0018) decode the lists of one kind and sign once per process. Keyed
# by the database, the run and its start time (an id reused by a new run is another entry); a run not yet
# done is read again each time.
RUN_LISTS_KEPT = 4  # SmolLM2's value tokens of one readout and direction: ~11 MB decoded


_RUN_LISTS = ProcessCache(RUN_LISTS_KEPT)  # (database, run id, started_at, kind, sign) -> Lists


def run_lists(*, session: Session, run_id: int, kind: str, sign: int) -> Lists:
    """Every list of one kind and sign of a run, decoded."""
    run = session.get(Run, run_id)
    if run is None:
        return memory_lists.decode_many(kind, [], [], [])
    cache_key = (database_of(session), run_id, run.started_at, kind, sign)
    found = _RUN_LISTS.get(cache_key)
    if found is None:
        query = select(MemoryList.layer, MemoryList.key, MemoryList.data).where(
            MemoryList.run_id == run_id, MemoryList.kind == kind, MemoryList.sign == sign
        )
        rows = session.execute(query.order_by(MemoryList.layer, MemoryList.key)).all()
        found = memory_lists.decode_many(
            kind, [r.layer for r in rows], [r.key for r in rows], [r.data for r in rows]
        )
        _RUN_LISTS.put(cache_key, found, final=run.status == RunStatus.done)
    return found


def get_key_stats(*, session: Session, run_id: int, layer: int, key: int) -> KeyStats | None:
    """One key's statistics, if stored."""
    return session.get(KeyStats, (run_id, layer, key))


def run_key_stats(*, session: Session, run_id: int, columns: Sequence[str]) -> list[Row]:
    """These columns (by name) of every key's statistics of a run, by layer and key."""
    query = (
        select(*(getattr(KeyStats, column) for column in columns))
        .where(KeyStats.run_id == run_id)
        .order_by(KeyStats.layer, KeyStats.key)
    )
    return list(session.execute(query))


KEY_SORTS = (
    "key",
    "max_coefficient",
    "min_coefficient",
    "positive_share",
    "density",
    "agreement",
    "max_prob",
    "next_token_rank",
    "value_norm",
    "dominant_quadrant",
    *QUADRANT_COLUMNS,
    "explanation",  # the explanation's score (explanations.score: the scoring protocol's pooled Pearson)
)


# The model page's figures aggregate every key's statistics (458,752 rows at 8B: ~150 ms): a finished run's
# are computed once per process, 32 rows a run.
_LAYER_SUMMARIES = ProcessCache(64)  # (database, run id, started_at) -> rows


def layer_summaries(*, session: Session, run_id: int) -> list[Row]:
    """One row per layer: key count and aggregates of the key statistics (see results.LayerFigures)."""
    run = session.get(Run, run_id)
    cache_key = (database_of(session), run_id, run.started_at if run else None)
    found = _LAYER_SUMMARIES.get(cache_key)
    if found is None:
        found = _layer_summaries(session, run_id)
        _LAYER_SUMMARIES.put(cache_key, found, final=run is not None and run.status == RunStatus.done)
    return found


def _layer_summaries(session: Session, run_id: int) -> list[Row]:
    top_agrees = case((KeyStats.next_token_rank == 0, 1.0), (KeyStats.next_token_rank.is_not(None), 0.0))
    query = (
        select(
            KeyStats.layer,
            func.count().label("keys"),
            func.avg(KeyStats.positive_share).label("positive_share"),
            func.avg(KeyStats.density).label("density"),
            func.max(KeyStats.max_coefficient).label("max_coefficient"),
            func.max(KeyStats.max_prob).label("max_prob"),
            func.avg(KeyStats.max_prob).label("mean_max_prob"),
            func.avg(top_agrees).label("agreement_rate"),
            func.sum(case((KeyStats.agreement > 0, 1), else_=0)).label("agreeing_keys"),
            func.count(KeyStats.agreement).label("keys_with_agreement"),
            func.avg(KeyStats.value_norm).label("value_norm"),
        )
        .where(KeyStats.run_id == run_id)
        .group_by(KeyStats.layer)
        .order_by(KeyStats.layer)
    )
    return list(session.execute(query))


def layer_keys(
    *,
    session: Session,
    run_id: int,
    layer: int,
    sort: str,
    descending: bool,
    offset: int,
    limit: int,
    token_ids: Sequence[int] | None = None,
    readout: str = "raw",
) -> tuple[int, list[KeyStats]]:
    """(number of keys that pass the filter, one page of them) for the layer table.

    `token_ids`: keep only keys whose value has one of these among its top tokens. NULLs sort last.
    """
    if sort not in KEY_SORTS:
        raise ValueError(f"unknown sort {sort!r}; choose from {', '.join(KEY_SORTS)}")
    where = [KeyStats.run_id == run_id, KeyStats.layer == layer]
    if token_ids is not None:
        keys = promoting_keys(
            session=session, run_id=run_id, layer=layer, token_ids=token_ids, readout=readout
        )
        where.append(KeyStats.key.in_(keys))
    total = session.scalar(select(func.count()).select_from(KeyStats).where(*where))
    # A page nearer the end is read from the other end in the reverse order: the database's sort of a
    # page keeps offset + limit rows (a late page of 14,336 keys: all of them), from the end only the few.
    from_end = offset > total - offset - limit
    if from_end:
        offset, limit = max(total - offset - limit, 0), max(min(limit, total - offset), 0)
    order = _key_order(sort, descending, reverse=from_end)
    if sort == "key":  # the primary key's order: the page's rows at once
        page = list(
            session.scalars(select(KeyStats).where(*where).order_by(*order).offset(offset).limit(limit))
        )
    else:  # the sort carries the key alone (half the time of whole rows at 14,336 keys), then the page's rows
        keys = select(KeyStats.key).where(*where)
        if sort == "explanation":
            keys = keys.outerjoin(
                Explanation,
                (Explanation.run_id == KeyStats.run_id)
                & (Explanation.layer == KeyStats.layer)
                & (Explanation.key == KeyStats.key),
            )
        keys = list(session.scalars(keys.order_by(*order).offset(offset).limit(limit)))
        found = session.scalars(select(KeyStats).where(*where[:2], KeyStats.key.in_(keys)))
        rows = {row.key: row for row in found}
        page = [rows[key] for key in keys]
    return total, page[::-1] if from_end else page


def _dominant_share():
    """A gated key's share of positions in its dominant quadrant (NULL for an ungated one)."""
    return case(
        *((KeyStats.dominant_quadrant == i, getattr(KeyStats, c)) for i, c in enumerate(QUADRANT_COLUMNS))
    )


def _key_order(sort: str, descending: bool, *, reverse: bool) -> list:
    """The layer table's order (`reverse`: backwards): by key, the primary key's (no sort); by a
    statistic, NULLs last (`IS NULL` sorts false first on both databases), then it, then the key. By the
    dominant quadrant: within each, by its share, the largest first."""
    column = Explanation.score if sort == "explanation" else getattr(KeyStats, sort)
    ordering = [column.desc() if descending != reverse else column.asc()]
    if sort == "dominant_quadrant":
        ordering.append(_dominant_share().asc() if reverse else _dominant_share().desc())
    if sort != "key":
        nulls = column.is_(None)
        ordering = [
            nulls.desc() if reverse else nulls,
            *ordering,
            KeyStats.key.desc() if reverse else KeyStats.key,
        ]
    return ordering


def promoting_keys(
    *, session: Session, run_id: int, layer: int, token_ids: Sequence[int], readout: str = "raw"
) -> list[int]:
    """The keys of a layer whose value has one of `token_ids` among its top tokens, ascending. The
    database keeps the lists whose bytes hold one of the ids (`holds_bytes`, a byte search in C over the
    layer's 14,336 lists at 8B) and only those are decoded here, where the ids are checked in place (a
    byte match may straddle an id and a logit)."""
    patterns = [int(t).to_bytes(2 if t < 2**16 else 4, "little") for t in token_ids]  # as stored (2 or 4 B)
    if not patterns:
        return []
    query = select(MemoryList.key, MemoryList.data).where(
        MemoryList.run_id == run_id,
        MemoryList.kind == readout,
        MemoryList.sign == 1,
        MemoryList.layer == layer,
        or_(*(holds_bytes(MemoryList.data, pattern) for pattern in patterns)),
    )
    rows = session.execute(query.order_by(MemoryList.key)).all()
    found = memory_lists.decode_many(
        readout, [layer] * len(rows), [r.key for r in rows], [r.data for r in rows]
    )
    hits = np.isin(found.entries["token_id"], np.asarray(list(token_ids), np.int64))  # [entries]
    return np.unique(found.key[hits]).tolist()


class holds_bytes(FunctionElement):
    """`blob` contains the bytes `pattern` anywhere: SQLite's instr(blob, pattern), Postgres's position."""

    type = Boolean()
    inherit_cache = True

    def __init__(self, blob, pattern: bytes) -> None:
        super().__init__(blob, literal(pattern, LargeBinary()))


@compiles(holds_bytes)
def _holds_bytes(element, compiler, **kw) -> str:
    blob, pattern = (compiler.process(clause, **kw) for clause in element.clauses)
    return f"(instr({blob}, {pattern}) > 0)"


@compiles(holds_bytes, "postgresql")
def _holds_bytes_postgres(element, compiler, **kw) -> str:
    blob, pattern = (compiler.process(clause, **kw) for clause in element.clauses)
    return f"(position({pattern} in {blob}) > 0)"


def top_triggers(*, session: Session, run_id: int, layer: int, keys: Sequence[int]) -> dict[int, Trigger]:
    """Each key's strongest positive trigger."""
    found = _layer_lists(session, run_id, TRIGGERS, 1, layer, keys)
    first = found.take(np.flatnonzero(found.rank == 0))
    return {
        key: Trigger(run_id, layer, key, 1, 0, s, p, c)
        for key, (s, p, c) in zip(first.key.tolist(), first.entries.tolist(), strict=True)
    }


def top_value_tokens(
    *, session: Session, run_id: int, layer: int, keys: Sequence[int], readout: str, n: int
) -> dict[int, list[ValueToken]]:
    """Each key's first `n` top value tokens under one readout, rank order."""
    query = select(MemoryList.key, MemoryList.data).where(
        MemoryList.run_id == run_id,
        MemoryList.kind == readout,
        MemoryList.sign == 1,
        MemoryList.layer == layer,
        MemoryList.key.in_([int(k) for k in keys]),
    )
    where = dict(run_id=run_id, layer=layer, readout=readout, direction=1, limit=n)
    return {
        key: memory_lists.value_tokens_of(data, key=key, **where)
        for key, data in session.execute(query.order_by(MemoryList.key))
    }


def memory_value_tokens(
    *, session: Session, run_id: int, readout: str, memories: Iterable[tuple[int, int, int]], n: int | None
) -> dict[tuple[int, int, int], list[int]]:
    """(layer, key, direction) → the first `n` token ids (all when None) of that value's top (+1) or
    bottom (−1) list."""
    listed = memory_value_lists(session=session, run_id=run_id, readout=readout, memories=memories)
    return {memory: entries["token_id"][:n].tolist() for memory, (entries, _) in listed.items()}


def memory_value_lists(
    *, session: Session, run_id: int, readout: str, memories: Iterable[tuple[int, int, int]]
) -> dict[tuple[int, int, int], tuple[np.ndarray, float]]:
    """(layer, key, direction) → that value's top (+1) or bottom (−1) list under `readout`: its entries
    (memory_lists.value_entry records, by rank) and the value's log Z."""
    wanted = set(memories)
    if not wanted:
        return {}
    keys_by_layer: dict[int, set[int]] = {}
    for layer, key, _ in wanted:
        keys_by_layer.setdefault(layer, set()).add(key)
    # One SELECT per layer, UNION ALL-ed: each walks the primary key (run, kind, sign, layer, key).
    per_layer = [
        select(MemoryList.layer, MemoryList.key, MemoryList.sign, MemoryList.data).where(
            MemoryList.run_id == run_id,
            MemoryList.kind == readout,
            MemoryList.sign.in_([1, -1]),
            MemoryList.layer == layer,
            MemoryList.key.in_(sorted(keys)),
        )
        for layer, keys in sorted(keys_by_layer.items())
    ]
    return {
        (layer, key, direction): memory_lists.decode_value_tokens(data)
        for layer, key, direction, data in session.execute(union_all(*per_layer))
        if (layer, key, direction) in wanted
    }


def value_matches(
    *,
    session: Session,
    run_id: int,
    token_ids: Sequence[int],
    readout: str,
    direction: int,
    by: str,
    limit: int,
) -> list[ValueToken]:
    """Values, across all layers, with one of `token_ids` among their top (+1) or bottom (−1) tokens.

    Strongest first: by probability (`by="prob"`) or logit (`"logit"`), descending for the top
    tokens and ascending for the bottom ones; ties by layer and key.
    """
    lists = run_lists(session=session, run_id=run_id, kind=readout, sign=direction)
    found = lists.take(
        np.flatnonzero(np.isin(lists.entries["token_id"], np.asarray(list(token_ids), np.int64)))
    )
    logits = found.entries["logit"].astype(np.float64)  # [found]
    score = logits - found.log_z if by == "prob" else logits  # log prob: the same order as prob
    order = np.lexsort((found.key, found.layer, -score if direction == 1 else score))[:limit]
    probs = memory_lists.probabilities(logits, found.log_z)  # [found]
    return [
        ValueToken(
            run_id,
            int(found.layer[i]),
            int(found.key[i]),
            readout,
            direction,
            int(found.rank[i]),
            int(found.entries["token_id"][i]),
            float(found.entries["logit"][i]),
            float(probs[i]),
        )
        for i in order.tolist()
    ]


def triggers_from(
    *, session: Session, run_id: int, n_keys: int, first_positions: dict[int, int], limit: int
) -> list[SentenceTrigger]:
    """The strongest positive triggers whose prefix (sentence, position) reaches past `first_positions`,
    the strongest first (ties by layer and key), at most `limit`: `first_positions` maps a sentence index
    to the first position whose prefix qualifies. Reads those sentences' rows of `sentence_triggers`."""
    rows = session.execute(
        select(SentenceTriggers.sentence_index, SentenceTriggers.data).where(
            SentenceTriggers.run_id == run_id, SentenceTriggers.sentence_index.in_(sorted(first_positions))
        )
    ).all()
    found = []
    for sentence_index, data in rows:
        entries = memory_lists.decode_sentence_triggers(data)  # [triggers in the sentence]
        entries = entries[entries["position"] >= first_positions[sentence_index]]
        layer, key = np.divmod(entries["memory"].astype(np.int64), n_keys)
        found += zip(layer.tolist(), key.tolist(), repeat(sentence_index), entries["position"].tolist(),
                     entries["coefficient"].tolist())  # fmt: skip
    found.sort(key=lambda t: (-t[4], t[0], t[1]))
    return [SentenceTrigger(*t) for t in found[:limit]]
