"""Which memories feed which and explanations without an API key: `memory_links` (each memory's
strongest links in its run's weight graph, both ways) and `explanations` (each memory's automatic
description and its score on held-out sentences). Runs stored before this revision have neither until
`ffmem compose` computes them.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade the schema."""
    op.create_table(
        "memory_links",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.Integer(), nullable=False),
        sa.Column("direction", sa.String(length=3), nullable=False),
        sa.Column("links", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_memory_links_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "layer", "key", "direction", name=op.f("pk_memory_links")),
    )
    op.create_table(
        "explanations",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(length=100), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("pattern", sa.JSON(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_explanations_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "layer", "key", name=op.f("pk_explanations")),
    )


def downgrade() -> None:
    """Downgrade the schema."""
    op.drop_table("explanations")
    op.drop_table("memory_links")
