"""Packed neighbours (issue 15's storage target): `neighbours.neighbours` (JSON [[layer, key, cosine], …])
becomes `data`, 10-byte records (layer int16, key int32, cosine float32; ffmem.store.memory_search's
NEIGHBOUR, copied here so this revision keeps working if it changes). Downgrading writes the JSON again,
cosines rounded to 6 decimals as before.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NEIGHBOUR = np.dtype([("layer", "<i2"), ("key", "<i4"), ("cosine", "<f4")])


def _convert(up: bool) -> None:
    """Rewrite every row, one (run, layer) at a time."""
    connection = op.get_bind()
    table = sa.table(
        "neighbours",
        *map(sa.column, ("run_id", "layer", "key", "kind")),
        sa.column("data", sa.LargeBinary),
        sa.column("neighbours", sa.JSON),
    )
    c = table.c
    parts = connection.execute(sa.select(c.run_id, c.layer).distinct().order_by(c.run_id, c.layer)).all()
    for run_id, layer in parts:
        rows = connection.execute(
            sa.select(c.key, c.kind, c.neighbours if up else c.data).where(
                c.run_id == run_id, c.layer == layer
            )
        ).all()
        updates = []
        for key, kind, found in rows:
            if up:
                listed = found if isinstance(found, list) else json.loads(found)
                packed = np.array([(int(lay), int(k), float(cos)) for lay, k, cos in listed], NEIGHBOUR)
                updates.append(dict(k=key, kind_=kind, data_=packed.tobytes(), neighbours_=None))
            else:
                listed = [[lay, k, round(cos, 6)] for lay, k, cos in np.frombuffer(found, NEIGHBOUR).tolist()]
                updates.append(dict(k=key, kind_=kind, data_=None, neighbours_=listed))
        if updates:
            target = "data" if up else "neighbours"
            statement = (
                sa.update(table)
                .where(
                    c.run_id == run_id,
                    c.layer == layer,
                    c.key == sa.bindparam("k"),
                    c.kind == sa.bindparam("kind_"),
                )
                .values({target: sa.bindparam(f"{target}_")})
            )
            connection.execute(statement, updates)


def upgrade() -> None:
    """Add `data`, pack every row's neighbours into it, drop the JSON column."""
    with op.batch_alter_table("neighbours") as batch:
        batch.add_column(sa.Column("data", sa.LargeBinary(), nullable=True))
    _convert(up=True)
    with op.batch_alter_table("neighbours") as batch:
        batch.drop_column("neighbours")
        batch.alter_column("data", existing_type=sa.LargeBinary(), nullable=False)


def downgrade() -> None:
    """Restore the JSON column; drop `data`."""
    with op.batch_alter_table("neighbours") as batch:
        batch.add_column(sa.Column("neighbours", sa.JSON(), nullable=True))
    _convert(up=False)
    with op.batch_alter_table("neighbours") as batch:
        batch.drop_column("data")
        batch.alter_column("neighbours", existing_type=sa.JSON(), nullable=False)
