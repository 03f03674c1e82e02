"""The random-pair baseline of memory neighbours: `neighbour_baselines` (per run, layer and kind, the mean
and 99th percentile of |cosine| over a fixed seeded sample of random pairs,
ffmem.engine.relations.neighbours). Runs
stored before this revision have none: their related sections show no baseline and mark nothing.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade the schema."""
    op.create_table(
        "neighbour_baselines",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("pairs", sa.Integer(), nullable=False),
        sa.Column("mean", sa.Float(), nullable=False),
        sa.Column("p99", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_neighbour_baselines_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "layer", "kind", name=op.f("pk_neighbour_baselines")),
    )


def downgrade() -> None:
    """Downgrade the schema."""
    op.drop_table("neighbour_baselines")
