"""A run's status checked, as jobs' and shards' are (revision 0006): `runs.status` holds one of
ffmem.store.models.RunStatus's values, running, done or failed (the only ones ever stored).

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0017"
down_revision: str | Sequence[str] | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.create_check_constraint(op.f("ck_runs_status"), "status IN ('running', 'done', 'failed')")


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint(op.f("ck_runs_status"), type_="check")
