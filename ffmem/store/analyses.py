"""The paper's analyses of a run as stored (one row per analysis: its figures' data and its time): read by
the analysis page and the CLI; the worker's analysis and composition stages write them, and the analysis
stage also writes each sampled key's token-removal figures into its statistics (`key_stats`)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from ffmem.store.models import Analysis, KeyStats


def stored_analyses(*, session: Session, run_id: int) -> dict[str, Analysis]:
    """The run's stored analyses by name."""
    query = select(Analysis).where(Analysis.run_id == run_id)
    return {analysis.name: analysis for analysis in session.scalars(query)}


def store_analysis(
    *, session: Session, run_id: int, name: str, options: dict, data: dict, seconds: float
) -> None:
    """Store one analysis of a run (how it was computed, its figures' data, its seconds), replacing any of
    the same name; the caller commits."""
    session.execute(delete(Analysis).where(Analysis.run_id == run_id, Analysis.name == name))
    session.add(
        Analysis(
            run_id=run_id,
            name=name,
            options=options,
            data=data,
            seconds=seconds,
            created_at=datetime.now(timezone.utc),
        )
    )


def store_token_removal(
    *,
    session: Session,
    run_id: int,
    changes: Mapping[tuple[int, int], tuple[float | None, float | None, float | None]],
) -> None:
    """Store the token-removal analysis's figures of the sampled keys in their statistics: (layer, key) →
    (mean change without the first token, mean change without the last, shallowness); every other key of
    the run is left with none."""
    session.execute(
        update(KeyStats)
        .where(KeyStats.run_id == run_id)
        .values(first_token_change=None, last_token_change=None, shallowness=None)
    )
    for (layer, key), (first, last, shallowness) in changes.items():
        session.execute(
            update(KeyStats)
            .where(KeyStats.run_id == run_id, KeyStats.layer == layer, KeyStats.key == key)
            .values(first_token_change=first, last_token_change=last, shallowness=shallowness)
        )
