"""Keyword-only reads and writes of what a run knows about its memories together: the weight graph
(`memory_links`: which memories feed which) and the automatic explanations (`explanations`). No torch:
array inputs are numpy arrays."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, repeat

import numpy as np
from sqlalchemy import delete, func, literal_column, or_, select
from sqlalchemy import text as sa_text
from sqlalchemy.orm import Session, undefer

from ffmem.store.bulk import bulk_insert, collector_paused
from ffmem.store.memory_lists import SCORED_MEMORY, pack_columns, unpack_columns
from ffmem.store.memory_writes import same_shape
from ffmem.store.models import Explanation, MemoryLinks
from ffmem.store.vocabularies import stored_text

DIRECTIONS = ("in", "out")  # in: earlier memories writing into the key; out: later keys reading the value


@dataclass(frozen=True)
class Link:
    layer: int
    key: int
    score: float


def delete_links(*, session: Session, run_id: int) -> None:
    """Drop a run's weight graph (before it is computed again)."""
    session.execute(delete(MemoryLinks).where(MemoryLinks.run_id == run_id))


def delete_explanations(*, session: Session, run_id: int) -> None:
    """Drop a run's explanations (before they are computed again)."""
    session.execute(delete(Explanation).where(Explanation.run_id == run_id))


def store_links(
    *, session: Session, run_id: int, links: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
) -> dict[str, int]:
    """Store every memory's links, a row a memory with both directions: `links[direction]` ("in", "out")
    is (layers, keys, scores), [n_layers, d_ff, n] arrays of the other memory's layer (−1: an empty slot)
    and key and the score, strongest first. A memory with no link either way gets no row. Returns, per
    direction, the memories with links that way."""
    if unknown := set(links) - set(DIRECTIONS):
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {sorted(unknown)[0]!r}")
    blobs, kept = {}, {}
    for direction, (layers, keys, scores) in links.items():
        layers, keys, scores = same_shape(3, layers=layers, keys=keys, scores=scores)
        packed = np.empty(layers.shape, SCORED_MEMORY)  # [n_layers, d_ff, n]
        packed["layer"], packed["key"], packed["score"] = layers, keys, scores
        kept[direction] = layers >= 0  # [n_layers, d_ff, n]
        blobs[direction] = _memory_blobs(packed, kept[direction])  # [n_layers · d_ff]
    shape = next(iter(kept.values())).shape[:2] if kept else (0, 0)
    found = [blobs.get(d, repeat(None)) for d in DIRECTIONS]
    linked = np.zeros(shape, bool)  # [n_layers, d_ff]: a memory with a link either way
    for either in kept.values():
        linked |= either.any(axis=2)
    layers, keys = (part.tolist() for part in np.nonzero(linked))  # [linked] each, in memory order
    if linked.all():
        rows = zip(layers, keys, *found, strict=False)  # a missing direction: repeat(None)
    else:
        at = np.flatnonzero(linked).tolist()
        picked = (map(part.__getitem__, at) if isinstance(part, list) else part for part in found)
        rows = zip(layers, keys, *picked, strict=False)
    columns = ("layer", "key", "inbound", "outbound")
    bulk_insert(session, MemoryLinks.__table__, columns, rows, fixed={"run_id": run_id})
    return {d: int(kept[d].any(axis=2).sum()) for d in kept}


def _memory_blobs(packed: np.ndarray, kept: np.ndarray) -> list[bytes | None]:
    """Each memory's kept entries of [n_layers, d_ff, n] records as bytes (None: none kept), in memory
    order: the kept entries' bytes at once, then each memory's slice of them."""
    counts = kept.reshape(-1, kept.shape[-1]).sum(axis=1) * packed.dtype.itemsize  # [memories]: bytes
    data = packed[kept].tobytes()  # row-major: memory after memory
    ends = np.cumsum(counts)  # [memories]
    starts = ends - counts  # [memories]
    return [data[a:b] if a < b else None for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]


def get_links(*, session: Session, run_id: int, layer: int, key: int) -> dict[str, list[Link]] | None:
    """A memory's links both ways ({"in": [...], "out": [...]}), or None when the run has no weight graph."""
    row = session.execute(
        select(MemoryLinks.inbound, MemoryLinks.outbound).where(
            MemoryLinks.run_id == run_id, MemoryLinks.layer == layer, MemoryLinks.key == key
        )
    ).first()
    if row is None and not has_links(session=session, run_id=run_id):
        return None
    found = {direction: [] for direction in DIRECTIONS}
    # scores to 5 significant digits, as shown
    for direction, data in zip(DIRECTIONS, row or (), strict=False):
        links = np.frombuffer(data or b"", SCORED_MEMORY).tolist()
        found[direction] = [Link(layer, other, float(f"{score:.5g}")) for layer, other, score in links]
    return found


def has_links(*, session: Session, run_id: int) -> bool:
    query = select(MemoryLinks.run_id).where(MemoryLinks.run_id == run_id).limit(1)
    return session.scalars(query).first() is not None


def store_explanations(*, session: Session, run_id: int, rows: Iterable[tuple]) -> None:
    """Store explanations: rows of (layer, key, source, text, score or None, pattern dict, details dict);
    the patterns (ffmem.engine.explanations.fitting.Pattern.to_dict) packed as TOKEN_TABLE bytes, all at
    once (pack_token_tables). On SQLite the trigram table indexes the rows after they are in, in one
    statement (`_text_indexed_after`)."""
    with collector_paused():
        _store_explanations(session, run_id, list(rows))


def _store_explanations(session: Session, run_id: int, rows: list[tuple]) -> None:
    if not rows:
        return
    layers, keys, sources, texts, scores, patterns, details = zip(*rows, strict=True)
    columns = ("run_id", "layer", "key", "source", "text", "score", "token_table", "details")
    stored = zip(
        repeat(run_id),
        np.asarray(layers, np.int64).tolist(),
        np.asarray(keys, np.int64).tolist(),
        sources,
        map(stored_text, texts),
        scores,
        pack_token_tables(patterns),
        details,
    )
    with _text_indexed_after(session):
        bulk_insert(session, Explanation.__table__, columns, stored)


@contextmanager
def _text_indexed_after(session: Session) -> Iterator[None]:
    """On SQLite with the trigram table (EXPLANATION_TEXT), the explanations inserted inside are indexed
    afterwards by one INSERT … SELECT of their rows (a fifth of the work of its insert trigger, row by
    row): the trigger is dropped for the while and made again as it was, in the same transaction, so no
    other connection ever sees it missing. Elsewhere, nothing."""
    trigger = f"{EXPLANATION_TEXT}_insert"
    made = None
    if _has_text_index(session):
        found = sa_text("SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = :name")
        made = session.scalar(found, {"name": trigger})
    if made is None:
        yield
        return
    last = session.scalar(sa_text("SELECT coalesce(max(rowid), 0) FROM explanations"))
    session.execute(sa_text(f"DROP TRIGGER {trigger}"))
    try:
        yield
    finally:  # new rows get rowids above the largest (SQLite's rule below 2**63 − 1)
        session.execute(
            sa_text(
                f"INSERT INTO {EXPLANATION_TEXT}(rowid, text) "
                "SELECT rowid, text FROM explanations WHERE rowid > :last"
            ),
            {"last": last},
        )
        session.execute(sa_text(made))


# An explanation's pattern as stored: a header (the sign it predicts, +1: m, −1: −m; its tokens; its pairs),
# then the token ids and their weights (float16), then the (previous token, token) pairs' ids and their
# weights (float16). From revision 0032 on the ids are as wide as the pattern's largest needs (1 to 4 bytes,
# little-endian; all ones: −1, a pair's start of sentence) and the header's first byte says so:
# PACKED_TABLE + 4 · width + sign + 1, between 0x40 and 0x80, where the tables before hold the sign alone
# (int8: 0xff, 0 or 1) and their ids in int32 (revision 0024: 6 B a token, 10 a pair; 4 and 6 at a 49K
# vocabulary now, 5 and 8 at 128K–152K).
TOKEN_TABLE_HEADER = np.dtype([("sign", "i1"), ("tokens", "<u2"), ("pairs", "<u2")])
TOKEN_TABLE_PARTS = ("<i4", "<f2", "<i4", "<f2")  # before 0032: final ids, weights, pair ids, pair weights
PACKED_TABLE = 0x40
WEIGHT_LIMIT = float(np.finfo(np.float16).max)  # a weight beyond ±65,504 is stored as that bound


def pack_token_tables(patterns: Sequence[dict]) -> list[bytes]:
    """Pattern dicts ({"sign", "final", "weights", "pairs", "pair_weights"}) as TOKEN_TABLE bytes, one
    blob each; the weights to float16's precision (3 significant digits, as the key page shows them). In
    bulk: every pattern's lists flattened into one array each, then the patterns of each size (tokens,
    pairs, id width) laid out as one record array of that size."""
    if not patterns:
        return []
    count = len(patterns)
    tokens = np.fromiter((len(p["final"]) for p in patterns), np.int64, count)  # [patterns]
    pairs = np.fromiter((len(p["pairs"]) for p in patterns), np.int64, count)  # [patterns]
    weighed = np.fromiter((len(p["weights"]) for p in patterns), np.int64, count)
    pair_weighed = np.fromiter((len(p["pair_weights"]) for p in patterns), np.int64, count)
    if (weighed != tokens).any() or (pair_weighed != pairs).any():
        raise ValueError("a pattern has not one weight a token and one a pair")
    signs = np.fromiter((p["sign"] for p in patterns), np.int64, count)  # [patterns]
    final = _flat([p["final"] for p in patterns], np.int64)  # [tokens]
    weights = _flat([p["weights"] for p in patterns], np.float64)  # [tokens]
    pair_ids = _flat([p["pairs"] for p in patterns], np.int64, nested=True)  # [2 · pairs]
    pair_weights = _flat([p["pair_weights"] for p in patterns], np.float64)  # [pairs]
    token_starts, pair_starts = np.cumsum(tokens) - tokens, np.cumsum(pairs) - pairs  # [patterns] each
    largest = np.maximum(  # [patterns]: each pattern's largest id, its tokens' and its pairs'
        _largest(final, token_starts, tokens), _largest(pair_ids, 2 * pair_starts, 2 * pairs)
    )
    widths = _id_widths(largest)  # [patterns]: each pattern's id width in bytes
    sizes = (tokens * (pairs.max() + 1) + pairs) * 5 + widths  # [patterns]: one per (tokens, pairs, width)
    order = np.argsort(sizes, kind="stable")  # [patterns], by size
    bounds = np.flatnonzero(np.diff(sizes[order])) + 1
    packed = [b""] * count
    for rows in np.split(order, bounds):
        n, p, width = int(tokens[rows[0]]), int(pairs[rows[0]]), int(widths[rows[0]])
        table = np.zeros(len(rows), _table_record(n, p, width))  # [rows]
        table["header"]["sign"] = (PACKED_TABLE + 4 * width + signs[rows] + 1).astype(np.uint8).view(np.int8)
        table["header"]["tokens"], table["header"]["pairs"] = n, p
        if n:
            at = token_starts[rows, None] + np.arange(n)  # [rows, n]
            table["final"] = pack_columns([final[at]], [width]).reshape(len(rows), n * width)
            table["weights"] = _float16(weights[at])
        if p:
            at = pair_starts[rows, None] + np.arange(p)  # [rows, p]
            table["pair_weights"] = _float16(pair_weights[at])
            at = 2 * pair_starts[rows, None] + np.arange(2 * p)  # [rows, 2p]
            table["pairs"] = pack_columns([pair_ids[at]], [width]).reshape(len(rows), 2 * p * width)
        blobs = table.view(np.dtype((np.void, table.dtype.itemsize))).tolist()  # bytes, zeros kept
        for at, blob in zip(rows.tolist(), blobs, strict=True):
            packed[at] = blob
    return packed


def _largest(ids: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each pattern's largest id (its `counts` ids from `starts` of `ids`), 0 where it has none."""
    largest = np.zeros(len(counts), np.int64)  # [patterns]
    some = counts > 0
    if some.any():
        largest[some] = np.maximum.reduceat(ids, starts[some])
    return largest


def _id_widths(largest: np.ndarray) -> np.ndarray:
    """memory_lists.int_width of each pattern's largest id, its all-ones code kept free for −1: [patterns]."""
    top = np.maximum(largest, 0) + 1  # [patterns]
    return 1 + (top >= 2**8) + (top >= 2**16) + (top >= 2**24)


def _table_record(n: int, p: int, width: int) -> np.dtype:
    """One packed token table of n tokens and p pairs, ids in `width` bytes, as a record (no padding)."""
    fields = [("header", TOKEN_TABLE_HEADER)]
    parts = (("u1", n * width), ("<f2", n), ("u1", 2 * p * width), ("<f2", p))
    for name, (dtype, size) in zip(("final", "weights", "pairs", "pair_weights"), parts, strict=True):
        fields.append((name, dtype, (size,)))
    return np.dtype(fields)


def _flat(lists: list, dtype: type, *, nested: bool = False) -> np.ndarray:
    """Lists of numbers (`nested`: of pairs of numbers), or numpy arrays of them, as one flat array."""
    if lists and all(isinstance(part, np.ndarray) for part in lists):
        return np.concatenate([part.reshape(-1) for part in lists]).astype(dtype)
    numbers = chain.from_iterable(chain.from_iterable(lists) if nested else lists)
    return np.fromiter(numbers, dtype)


def _float16(weights: np.ndarray) -> np.ndarray:
    """Weights as stored: float16, those beyond its range at its bound."""
    return np.clip(weights, -WEIGHT_LIMIT, WEIGHT_LIMIT).astype("<f2")


def unpack_token_table(data: bytes) -> dict:
    """pack_token_table's bytes (or a table stored before 0032, ids in int32) as the pattern dict (weights
    as float16 holds them, to 4 digits)."""
    header = np.frombuffer(data, TOKEN_TABLE_HEADER, count=1)[0]
    n, p = int(header["tokens"]), int(header["pairs"])
    first = data[0]
    packed = PACKED_TABLE <= first < 0x80
    width, sign = ((first - PACKED_TABLE) // 4, (first & 3) - 1) if packed else (4, int(header["sign"]))
    at = TOKEN_TABLE_HEADER.itemsize
    parts = []
    for dtype, count in zip(("ids", "<f2", "ids", "<f2"), (n, n, 2 * p, p), strict=True):
        if dtype == "ids" and packed:
            raw = np.frombuffer(data, np.uint8, count=count * width, offset=at).reshape(count, width)
            parts.append(unpack_columns(raw, [width], [True])[0])  # [count] int64
            at += raw.nbytes
            continue
        parts.append(np.frombuffer(data, "<i4" if dtype == "ids" else dtype, count=count, offset=at))
        at += parts[-1].nbytes
    final, weights, pairs, pair_weights = parts
    return {
        "sign": sign,
        "final": final.tolist(),
        "weights": [float(f"{w:.4g}") for w in weights.tolist()],
        "pairs": pairs.reshape(-1, 2).tolist(),
        "pair_weights": [float(f"{w:.4g}") for w in pair_weights.tolist()],
    }


def explanation_pattern(explanation: Explanation) -> dict:
    """A stored explanation's pattern: its token table, or the JSON of a run explained before 0023."""
    if explanation.token_table is not None:
        return unpack_token_table(explanation.token_table)
    return explanation.pattern


def get_explanation(*, session: Session, run_id: int, layer: int, key: int) -> Explanation | None:
    """A memory's explanation with its token table (deferred elsewhere: lists of explanations skip it), in
    one query."""
    return session.get(Explanation, (run_id, layer, key), options=[undefer(Explanation.token_table)])


def explanation_scores(
    *, session: Session, run_id: int, layer: int, keys: Sequence[int]
) -> dict[int, tuple[float | None, float | None]]:
    """key → (its explanation's score, its control's: the scoring protocol's pooled Pearson, with another
    memory's pattern for the control; None where unscored, and the control for runs explained before the
    protocol), for those of `keys` the run explains."""
    if not keys:
        return {}
    query = select(Explanation.key, Explanation.score, Explanation.details).where(
        Explanation.run_id == run_id, Explanation.layer == layer, Explanation.key.in_(sorted(set(keys)))
    )
    found = {}
    for key, score, details in session.execute(query):
        found[key] = (score, (protocol_of(details) or {}).get("pooled_control"))
    return found


def explanation_sides(explanation: Explanation) -> list[dict]:
    """Both sides of a memory as its explanation stores them ({"sign", "source", "text", "scores"}, m > 0
    first; the stronger side's text is the row's, stored once); none for a run explained before sides."""
    details = explanation.details or {}
    return [side | {"text": side.get("text", explanation.text)} for side in details.get("polarities", [])]


def explanation_quadrants(explanation: Explanation) -> list[dict]:
    """A gated memory's quadrants as its explanation stores them ({"quadrant", "sign", "text", "scores"},
    in the order pp, pn, np, nn, those with examples); none for an ungated memory or a run explained before
    quadrants were."""
    return list((explanation.details or {}).get("quadrants", []))


def protocol_of(details: dict | None) -> dict | None:
    """An explanation's details' scores of its stronger side by the scoring protocol (None: explained
    before the protocol, or unscored)."""
    details = details or {}
    return next(
        (s["scores"] for s in details.get("polarities", []) if s["sign"] == details.get("sign")), None
    )


def explanation_texts(
    *, session: Session, run_id: int, memories: set[tuple[int, int]]
) -> dict[tuple[int, int], str]:
    """(layer, key) → explanation text, for those of `memories` the run explains."""
    if not memories:
        return {}
    # Layers IN and keys IN (then the pairs kept here): primary-key lookups, where a row-value IN makes
    # SQLite read the whole run's explanations.
    query = select(Explanation.layer, Explanation.key, Explanation.text).where(
        Explanation.run_id == run_id,
        Explanation.layer.in_(sorted({layer for layer, _ in memories})),
        Explanation.key.in_(sorted({key for _, key in memories})),
    )
    found = {(layer, key): text for layer, key, text in session.execute(query)}
    return {memory: text for memory, text in found.items() if memory in memories}


def search_explanations(*, session: Session, run_id: int, text: str, limit: int) -> list[Explanation]:
    """Explanations whose text contains `text` (any case), the best scored first (unscored last). On
    SQLite a needle of 3 characters or more is looked up in the trigram index (EXPLANATION_TEXT,
    migration 0021) first; on Postgres `LIKE` reads the trigram index of lower(text) by itself."""
    needle = stored_text(text).lower()
    query = select(Explanation).where(
        Explanation.run_id == run_id, func.lower(Explanation.text).contains(needle, autoescape=True)
    )
    if len(needle) >= 3 and _has_text_index(session):
        phrase = '"' + needle.replace('"', '""') + '"'  # FTS5: the needle as one phrase, its trigrams
        found = sa_text(f"SELECT rowid FROM {EXPLANATION_TEXT} WHERE {EXPLANATION_TEXT} MATCH :phrase")
        query = query.where(literal_column("explanations.rowid").in_(found.bindparams(phrase=phrase)))
    query = query.order_by(
        or_(Explanation.score.is_(None)), Explanation.score.desc(), Explanation.layer, Explanation.key
    )
    return list(session.scalars(query.limit(limit)))


EXPLANATION_TEXT = "explanation_text"  # SQLite's FTS5 trigram table over explanations.text (migration 0021)


def _has_text_index(session: Session) -> bool:
    """Whether this SQLite database has the trigram table (an SQLite without FTS5's trigram has none)."""
    if session.get_bind().dialect.name != "sqlite":
        return False
    exists = sa_text("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = :name")
    return session.scalar(exists, {"name": EXPLANATION_TEXT}) is not None


def explanation_summary(*, session: Session, run_id: int) -> dict:
    """How many memories of a run are explained and scored, and their mean score."""
    count, scored, mean = session.execute(
        select(func.count(), func.count(Explanation.score), func.avg(Explanation.score)).where(
            Explanation.run_id == run_id
        )
    ).one()
    return {"explained": count, "scored": scored, "mean_score": None if mean is None else float(mean)}
