"""The nearest-neighbour baseline: `neighbour_baselines.nearest`, per run, layer and kind the median over
the layer's memories of each one's r-th nearest neighbour's cosine, r = 1 … k
(ffmem.engine.relations.neighbours).
Runs stored before this revision have NULL: their related sections say the baseline is unknown and mark
nothing.

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0026"
down_revision: str | Sequence[str] | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the column (NULL for runs stored before this revision)."""
    with op.batch_alter_table("neighbour_baselines") as batch:
        batch.add_column(sa.Column("nearest", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drop it."""
    with op.batch_alter_table("neighbour_baselines") as batch:
        batch.drop_column("nearest")
