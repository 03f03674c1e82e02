"""Composition jobs: a finished run's weight graph and explanations computed again (`ffmem compose`) as a
job of the new kind "composition" that any worker takes, as analyses are.

Revision ID: 0028
Revises: 0027
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0028"
down_revision: str | Sequence[str] | None = "0027"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACTIVE = "status IN ('queued', 'running')"


def _job_kinds(kinds: str) -> None:
    """Re-create the check of jobs.kind (SQLite rebuilds the table: the partial unique index goes first)."""
    op.drop_index("uq_jobs_active_fingerprint", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(op.f("ck_jobs_kind"), type_="check")
        batch.create_check_constraint(op.f("ck_jobs_kind"), f"kind IN ({kinds})")
    op.create_index(
        "uq_jobs_active_fingerprint",
        "jobs",
        ["fingerprint"],
        unique=True,
        sqlite_where=sa.text(ACTIVE),
        postgresql_where=sa.text(ACTIVE),
    )


def upgrade() -> None:
    """Allow the new kind."""
    _job_kinds("'index', 'analysis', 'comparison', 'composition'")


def downgrade() -> None:
    """Composition jobs are deleted: the older schema has no such kind."""
    op.execute(sa.text("DELETE FROM jobs WHERE kind = 'composition'"))
    _job_kinds("'index', 'analysis', 'comparison'")
