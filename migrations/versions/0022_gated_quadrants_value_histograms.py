"""Gated memories' sign quadrants and each value's logit histogram.

- `key_stats.quadrant_pp/pn/np/nn`: for a gated FF (coefficient act(x·g)·(x·u)), the share of mined
  positions whose gate act(x·g) and input x·u have each pair of signs (p: ≥ 0, n: < 0; the first letter
  the gate's), and `dominant_quadrant` (0 … 3 in that order) the largest; NULL for ungated FFs and runs
  stored before.
- `key_examples.quadrants`: the top examples of each quadrant (ffmem.store.key_examples packs them).
- `value_histograms`: per memory, the histogram of its value's logits over the whole vocabulary under
  both readouts (ffmem.store.value_histograms packs them).

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | Sequence[str] | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

QUADRANTS = ("quadrant_pp", "quadrant_pn", "quadrant_np", "quadrant_nn")


def upgrade() -> None:
    with op.batch_alter_table("key_stats") as batch:
        for name in QUADRANTS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))
        batch.add_column(sa.Column("dominant_quadrant", sa.SmallInteger(), nullable=True))
    with op.batch_alter_table("key_examples") as batch:
        batch.add_column(sa.Column("quadrants", sa.LargeBinary(), nullable=True))
    op.create_table(
        "value_histograms",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_value_histograms_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "layer", "key", name=op.f("pk_value_histograms")),
    )


def downgrade() -> None:
    op.drop_table("value_histograms")
    with op.batch_alter_table("key_examples") as batch:
        batch.drop_column("quadrants")
    with op.batch_alter_table("key_stats") as batch:
        batch.drop_column("dominant_quadrant")
        for name in reversed(QUADRANTS):
            batch.drop_column(name)
