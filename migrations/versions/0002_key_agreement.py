"""Key statistics for the explorer: density, the value's max probability, key–value agreement.

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


def upgrade() -> None:
    """Add the columns (NULL for runs stored before this revision)."""
    with op.batch_alter_table("key_stats") as batch:
        for name, kind in COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    """Drop them."""
    with op.batch_alter_table("key_stats") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
