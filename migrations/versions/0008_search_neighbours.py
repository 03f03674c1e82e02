"""Full-vocabulary token search and memory neighbours: `run_arrays` (a run's values, output embedding
and readout terms as .npy bytes, read by the web without torch) and `neighbours` (each memory's
nearest memories by key and by value direction). Runs stored before this revision have neither: their
token search covers the stored top / bottom value tokens, and their key pages show no neighbours.

Revision ID: 0008
Revises: 0006
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade the schema."""
    op.create_table(
        "run_arrays",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=40), nullable=False),
        sa.Column("part", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_arrays_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "name", "part", name=op.f("pk_run_arrays")),
    )
    op.create_table(
        "neighbours",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("neighbours", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_neighbours_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "layer", "key", "kind", name=op.f("pk_neighbours")),
    )


def downgrade() -> None:
    """Downgrade the schema."""
    op.drop_table("neighbours")
    op.drop_table("run_arrays")
