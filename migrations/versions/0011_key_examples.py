"""Examples across the range and every token shaded: `key_examples`, one row per key of a run with its
band samples and the coefficients at every token of its top triggers and samples (issue 15). Runs
stored before this revision have none: their key pages show the triggers as before.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade the schema."""
    op.create_table(
        "key_examples",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.Integer(), nullable=False),
        sa.Column("samples", sa.JSON(), nullable=False),
        sa.Column("positive", sa.SmallInteger(), nullable=False),
        sa.Column("negative", sa.SmallInteger(), nullable=False),
        sa.Column("shading", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_key_examples_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "layer", "key", name=op.f("pk_key_examples")),
    )


def downgrade() -> None:
    """Downgrade the schema."""
    op.drop_table("key_examples")
