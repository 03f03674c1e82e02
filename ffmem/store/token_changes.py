"""Keyword-only reads and writes of a run's TokenChange sample (`token_changes`): what sampled memories'
values write, measured by forward passes, with their output scores and their controls' (written by the
run's token_change step, ffmem.worker.token_changes; read by the key page). No torch."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ffmem.store.models import TokenChangeRow


def delete_token_changes(*, session: Session, run_id: int) -> None:
    """Drop a run's sample (before it is measured again)."""
    session.execute(delete(TokenChangeRow).where(TokenChangeRow.run_id == run_id))


def store_token_changes(*, session: Session, run_id: int, rows: Iterable[dict]) -> int:
    """Add sampled memories' rows (TokenChangeRow's fields but the run); how many."""
    found = [TokenChangeRow(run_id=run_id, **row) for row in rows]
    session.add_all(found)
    return len(found)


def get_token_change(*, session: Session, run_id: int, layer: int, key: int) -> TokenChangeRow | None:
    """A memory's row, None when the run did not sample it."""
    return session.get(TokenChangeRow, (run_id, layer, key))


def token_changes(*, session: Session, run_id: int) -> list[TokenChangeRow]:
    """The run's whole sample, by layer and key."""
    query = select(TokenChangeRow).where(TokenChangeRow.run_id == run_id)
    return list(session.scalars(query.order_by(TokenChangeRow.layer, TokenChangeRow.key)))
