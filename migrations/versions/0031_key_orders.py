"""Key orders: per run, layer and sort of the layer table, the layer's keys in that order (`key_orders`),
written with the key statistics, so that a page of the table is a slice and not a sort of the layer's
every row (issue 41: layers of 25,600 to 28,672 keys). The lists' integers are packed as wide as they
need from this revision on (ffmem.store.memory_lists); the lists stored before read as they were.
Runs stored before have no key orders: their pages sort the statistics as before.

Revision ID: 0031
Revises: 0030
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0031"
down_revision: str | Sequence[str] | None = "0030"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the table (empty: runs stored before have none)."""
    op.create_table(
        "key_orders",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("sort", sa.String(length=24), nullable=False),
        sa.Column("descending", sa.Boolean(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_key_orders_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "layer", "sort", "descending", name=op.f("pk_key_orders")),
    )


def downgrade() -> None:
    """Drop it."""
    op.drop_table("key_orders")
