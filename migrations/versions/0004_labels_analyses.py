"""Labels (people's pattern descriptions and shallow/semantic tags of memories, with their history),
analyses (the paper's per-layer figures computed on a run) and the per-key figures of Fig. 3.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


SHALLOWNESS = ("first_token_change", "last_token_change", "shallowness")


def upgrade() -> None:
    """Upgrade the schema."""
    with op.batch_alter_table("key_stats") as batch:
        for name in SHALLOWNESS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))
    op.create_table(
        "labels",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.Integer(), nullable=False),
        sa.Column("pattern", sa.Text(), nullable=False),
        sa.Column("tag", sa.String(length=16), nullable=False),
        sa.Column("author", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["language_models.id"],
            name=op.f("fk_labels_model_id_language_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_labels")),
    )
    op.create_index("ix_labels_memory", "labels", ["model_id", "layer", "key", "id"], unique=False)
    op.create_table(
        "analyses",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=40), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_analyses_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "name", name=op.f("pk_analyses")),
    )


def downgrade() -> None:
    """Downgrade the schema."""
    op.drop_table("analyses")
    op.drop_index("ix_labels_memory", table_name="labels")
    op.drop_table("labels")
    with op.batch_alter_table("key_stats") as batch:
        for name in reversed(SHALLOWNESS):
            batch.drop_column(name)
