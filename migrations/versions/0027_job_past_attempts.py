"""Each attempt at a job: `jobs.past_attempts`, the attempts that failed before the current one (a failed
job queued again: its start, its end and its error, oldest first), so the job's page shows every attempt
and the current one's own times. Jobs stored before this revision have NULL: no earlier attempt known.

Revision ID: 0027
Revises: 0026
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0027"
down_revision: str | Sequence[str] | None = "0026"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the column (NULL for jobs stored before this revision)."""
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("past_attempts", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drop it."""
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("past_attempts")
