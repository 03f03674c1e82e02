"""Packed weight-graph links (issue 15's storage target): `memory_links.links` (JSON [[layer, key, score],
…]) becomes `data`, 10-byte records (layer int16, key int32, score float32; ffmem.store.composition's
LINK, copied here so this revision keeps working if it changes). Downgrading writes the JSON again, scores
to 5 significant digits as before.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-25
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LINK = np.dtype([("layer", "<i2"), ("key", "<i4"), ("score", "<f4")])


def _convert(up: bool) -> None:
    """Rewrite every row, one (run, layer) at a time."""
    connection = op.get_bind()
    table = sa.table(
        "memory_links",
        *map(sa.column, ("run_id", "layer", "key", "direction")),
        sa.column("data", sa.LargeBinary),
        sa.column("links", sa.JSON),
    )
    c = table.c
    parts = connection.execute(sa.select(c.run_id, c.layer).distinct().order_by(c.run_id, c.layer)).all()
    for run_id, layer in parts:
        rows = connection.execute(
            sa.select(c.key, c.direction, c.links if up else c.data).where(
                c.run_id == run_id, c.layer == layer
            )
        ).all()
        updates = []
        for key, direction, found in rows:
            if up:
                listed = found if isinstance(found, list) else json.loads(found)
                packed = np.array([(int(lay), int(k), float(score)) for lay, k, score in listed], LINK)
                updates.append(dict(k=key, direction_=direction, data_=packed.tobytes(), links_=None))
            else:
                listed = [[lay, k, float(f"{s:.5g}")] for lay, k, s in np.frombuffer(found, LINK).tolist()]
                updates.append(dict(k=key, direction_=direction, data_=None, links_=listed))
        if updates:
            target = "data" if up else "links"
            statement = (
                sa.update(table)
                .where(
                    c.run_id == run_id,
                    c.layer == layer,
                    c.key == sa.bindparam("k"),
                    c.direction == sa.bindparam("direction_"),
                )
                .values({target: sa.bindparam(f"{target}_")})
            )
            connection.execute(statement, updates)


def upgrade() -> None:
    """Add `data`, pack every row's links into it, drop the JSON column."""
    with op.batch_alter_table("memory_links") as batch:
        batch.add_column(sa.Column("data", sa.LargeBinary(), nullable=True))
    _convert(up=True)
    with op.batch_alter_table("memory_links") as batch:
        batch.drop_column("links")
        batch.alter_column("data", existing_type=sa.LargeBinary(), nullable=False)


def downgrade() -> None:
    """Restore the JSON column; drop `data`."""
    with op.batch_alter_table("memory_links") as batch:
        batch.add_column(sa.Column("links", sa.JSON(), nullable=True))
    _convert(up=False)
    with op.batch_alter_table("memory_links") as batch:
        batch.drop_column("data")
        batch.alter_column("links", existing_type=sa.JSON(), nullable=False)
