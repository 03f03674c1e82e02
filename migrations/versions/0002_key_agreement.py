"""Explorer: key density, the value's max probability, key–value agreement; a search index on triggers.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("density", sa.Float()),
    ("max_prob", sa.Float()),
    ("agreement", sa.Integer()),
    ("next_token_rank", sa.Integer()),
)


SEARCH_INDEX = ("run_id", "sentence_index", "sign", "coefficient", "position")


def upgrade() -> None:
    """Add the columns (NULL for runs stored before this revision); widen the triggers' sentence index."""
    with op.batch_alter_table("key_stats") as batch:
        for name, kind in COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))
    op.drop_index("ix_triggers_sentence", table_name="triggers")
    op.create_index("ix_triggers_sentence", "triggers", list(SEARCH_INDEX))


def downgrade() -> None:
    """Drop them; narrow the index back."""
    op.drop_index("ix_triggers_sentence", table_name="triggers")
    op.create_index("ix_triggers_sentence", "triggers", ["run_id", "sentence_index"])
    with op.batch_alter_table("key_stats") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
