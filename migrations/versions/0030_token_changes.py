"""TokenChange: a sample of each run's memories with what their values write, measured by forward passes, and
its output score against a control (ffmem.store.models.composition.TokenChangeRow).

Revision ID: 0030
Revises: 0028
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0030"
down_revision: str | Sequence[str] | None = "0028"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "token_changes",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.Integer(), nullable=False),
        sa.Column("contexts", sa.Integer(), nullable=False),
        sa.Column("promoted", sa.JSON(), nullable=False),
        sa.Column("suppressed", sa.JSON(), nullable=False),
        sa.Column("overlap", sa.Float(), nullable=False),
        sa.Column("spearman", sa.Float(), nullable=False),
        sa.Column("control_key", sa.Integer(), nullable=False),
        sa.Column("control_overlap", sa.Float(), nullable=False),
        sa.Column("control_spearman", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_token_changes_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "layer", "key", name=op.f("pk_token_changes")),
    )


def downgrade() -> None:
    op.drop_table("token_changes")
