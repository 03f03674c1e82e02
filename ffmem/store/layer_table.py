"""The layer table's sorts: each key statistic it orders a layer's keys by (KEY_SORTS), a page of them
(`layer_keys`), and each sort's order of a finished run's layer, computed when its statistics are stored
(`key_orders`, the `key_orders` table), so that a page is a slice of the stored order and not a sort of
the layer's every row (a layer of Llama-3.3-70B holds 28,672 keys).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from ffmem.store import memory_lists
from ffmem.store.bulk import bulk_insert
from ffmem.store.memory_reads import promoting_keys
from ffmem.store.models import QUADRANT_COLUMNS, Explanation, KeyOrder, KeyStats

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
    if token_ids is None:  # a finished run's stored order: the page's slice of it, no sort
        ordered = _ordered_keys(session, run_id, layer, sort, descending, offset, limit)
        if ordered is not None:
            total, keys = ordered
            rows = {
                row.key: row
                for row in session.scalars(select(KeyStats).where(*where, KeyStats.key.in_(keys)))
            }
            return total, [rows[key] for key in keys if key in rows]
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
        if sort == "explanation":  # stored after the key orders: sorted here
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


def _ordered_keys(
    session: Session, run_id: int, layer: int, sort: str, descending: bool, offset: int, limit: int
) -> tuple[int, list[int]] | None:
    """(the layer's keys, the page's keys in order) from its stored key orders (KeyOrder), reading the
    page's slice alone; None for a run stored without them (before revision 0031). By key: the keys are
    0 … n − 1, their number the stored orders'."""
    order = ("max_coefficient", True) if sort == "key" else (sort, descending)
    where = (
        KeyOrder.run_id == run_id,
        KeyOrder.layer == layer,
        KeyOrder.sort == order[0],
        KeyOrder.descending == order[1],
    )
    head = session.execute(
        select(func.substr(KeyOrder.data, 1, 1), func.length(KeyOrder.data)).where(*where)
    ).first()
    if head is None:
        return None
    width = bytes(head[0])[0]
    total = (head[1] - 1) // width
    count = max(min(limit, total - offset), 0)
    if sort == "key":
        keys = range(offset, offset + count)
        return total, [total - 1 - key for key in keys] if descending else list(keys)
    if not count:
        return total, []
    part = session.scalar(select(func.substr(KeyOrder.data, 2 + offset * width, count * width)).where(*where))
    raw = np.frombuffer(bytes(part), np.uint8).reshape(count, width)  # [count, width]
    (keys,) = memory_lists.unpack_columns(raw, (width,), (False,))
    return total, keys.tolist()


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


def key_orders(statistics: dict[str, np.ndarray]) -> dict[tuple[str, bool], np.ndarray]:
    """(sort, descending) → the layer's keys [keys] in the layer table's order by that statistic, as the
    database sorts the stored values (_key_order): NULLs (NaN, ±inf) last, then
    the value, then the key; by the dominant quadrant, within each by its share, the largest first."""
    orders = {}
    for sort, values in statistics.items():
        values = np.asarray(values, np.float64)  # [keys]
        keys = np.arange(len(values))
        missing = ~np.isfinite(values)
        within = np.zeros(len(values))  # [keys]
        if sort == "dominant_quadrant":
            shares = np.stack([statistics[c] for c in QUADRANT_COLUMNS], axis=1).astype(
                np.float64
            )  # [keys, 4]
            dominant = np.where(missing, 0, values).astype(int)
            within = -np.nan_to_num(shares[keys, dominant])
        for descending in (True, False):
            primary = np.where(missing, 0.0, -values if descending else values)
            orders[sort, descending] = np.lexsort((keys, within, primary, missing))
    return orders


def store_key_orders(*, session: Session, run_id: int, layer: int, statistics: dict[str, np.ndarray]) -> None:
    """Store the layer's key orders (key_orders of these statistics [keys] each, NaN for NULL): each sort's
    keys, packed as wide as the layer needs after a width byte (memory_lists.pack_columns)."""
    orders = key_orders(statistics)
    width = memory_lists.int_width(np.array([len(next(iter(orders.values()))) - 1]))
    rows = (
        (
            run_id,
            int(layer),
            sort,
            descending,
            bytes([width]) + memory_lists.pack_columns((keys,), (width,)).tobytes(),
        )
        for (sort, descending), keys in orders.items()
    )
    bulk_insert(session, KeyOrder.__table__, ("run_id", "layer", "sort", "descending", "data"), rows)
