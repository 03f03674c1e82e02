"""What a run that is still mining knows so far, for the pages: its mined layers (the snapshot of its
merged shards and the running shards' checkpoints) merged with numpy. No torch here.

Values are projected when a run is prepared, so they are final already; triggers and statistics are
provisional until the run is stored.
"""

from __future__ import annotations

import numpy as np
from sqlalchemy.orm import Session

from ffmem.engine.mined_layer import MinedLayer
from ffmem.store import jobs, queries
from ffmem.store.models import KeyStats, Run, Trigger


def has_results(session: Session, run: Run) -> bool:
    """Whether the run has mined anything the pages can show."""
    return jobs.has_layers(session=session, run_id=run.id)


def mined_layer(session: Session, run: Run, layer: int) -> MinedLayer | None:
    """The layer as mined so far, over every stored part; None before the first checkpoint."""
    parts = [
        MinedLayer.from_bytes(data) for data in jobs.layer_parts(session=session, run_id=run.id, layer=layer)
    ]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else MinedLayer.merge(parts)


def fraction(run: Run, mined: MinedLayer | None) -> float:
    """Share of the corpus the provisional results cover."""
    return 0.0 if mined is None or not run.n_sentences else mined.sentences / run.n_sentences


def triggers(
    mined: MinedLayer, run: Run, layer: int, key: int, sign: int, limit: int | None = None
) -> list[Trigger]:
    """A key's triggers of one sign so far, strongest first, as (unsaved) Trigger rows."""
    sentence = mined.sentence[sign][key]  # [T]
    rows = [
        Trigger(
            run_id=run.id,
            layer=layer,
            key=key,
            sign=sign,
            rank=rank,
            sentence_index=int(sentence[rank]),
            position=int(mined.position[sign][key, rank]),
            coefficient=float(mined.coefficient[sign][key, rank]),
        )
        for rank in range(len(sentence))
        if sentence[rank] >= 0
    ]
    return rows[:limit] if limit is not None else rows


def extremes(mined: MinedLayer) -> tuple[np.ndarray, np.ndarray]:
    """(max, min) coefficient per key so far, NaN where no sentence was mined: [keys] each."""
    top, bottom = mined.coefficient[1][:, 0], mined.coefficient[-1][:, 0]
    return np.where(np.isfinite(top), top, np.nan), np.where(np.isfinite(bottom), bottom, np.nan)


def layer_keys(
    session: Session,
    run: Run,
    mined: MinedLayer,
    layer: int,
    *,
    sort: str,
    descending: bool,
    offset: int,
    limit: int,
    token_ids: list[int] | None,
) -> tuple[int, list[KeyStats], dict[int, Trigger]]:
    """queries.layer_keys and queries.top_triggers for a run still mining: (keys that pass the filter,
    one page of (unsaved) KeyStats rows with what is known so far, their top triggers)."""
    n_keys = mined.histogram.shape[0]
    _, probs = queries.layer_value_tokens(
        session=session, run_id=run.id, layer=layer, readout="raw", direction=1, n=1
    )
    high, low = extremes(mined)
    unknown = np.full(n_keys, np.nan)
    columns = {
        "key": np.arange(n_keys, dtype=float),
        "max_coefficient": high,
        "min_coefficient": low,
        "positive_share": mined.positive_share(),
        "density": mined.density(),
        "agreement": unknown,
        "max_prob": probs[:, 0] if probs.size else unknown,
        "next_token_rank": unknown,
        "value_norm": unknown,
    }
    keys = np.arange(n_keys)
    if token_ids is not None:
        keys = np.array(
            sorted(session.scalars(queries.promoting_keys(run_id=run.id, layer=layer, token_ids=token_ids)))
        )
        keys = keys.astype(np.int64)
    value = columns[sort][keys]  # NULLs (NaN) last, then by value, then by key
    missing = np.isnan(value)
    primary = np.where(missing, 0.0, -value if descending else value)
    page = keys[np.lexsort((keys, primary, missing))][offset : offset + limit]
    mean, share, dense = mined.mean(), columns["positive_share"], columns["density"]
    rows = [
        KeyStats(
            run_id=run.id,
            layer=layer,
            key=int(key),
            mean=float(mean[key]),
            positive_share=float(share[key]),
            max_coefficient=None if np.isnan(high[key]) else float(high[key]),
            min_coefficient=None if np.isnan(low[key]) else float(low[key]),
            value_norm=None,
            histogram=mined.histogram[key].tolist(),
            density=float(dense[key]),
            max_prob=None if np.isnan(columns["max_prob"][key]) else float(columns["max_prob"][key]),
            agreement=None,
            next_token_rank=None,
        )
        for key in page
    ]
    tops = {}
    for row in rows:
        found = triggers(mined, run, layer, row.key, 1, limit=1)
        if found:
            tops[row.key] = found[0]
    return len(keys), rows, tops
