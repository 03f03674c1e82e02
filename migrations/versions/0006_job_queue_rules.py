"""The job queue's rules in the schema: an analysis's wait for its index job as a foreign key
(`jobs.after_job_id`, moved out of `options["after"]`), kinds and statuses checked, at most one
queued or running job per fingerprint (a partial unique index), and shards counting their attempts.

Analysis jobs' options keep only what they compute: "after" moves to `after_job_id` and "run" (a copy
of `run_id`) goes; fingerprints are unchanged (jobs.job_fingerprint adds the run or the job waited for).
An analysis waiting for a job that is gone can never run and is deleted. Where several unfinished
jobs share a fingerprint (two commands that raced), the oldest stays and the others fail, saying so.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACTIVE = "status IN ('queued', 'running')"

jobs = sa.table(
    "jobs",
    sa.column("id", sa.Integer),
    sa.column("kind", sa.String),
    sa.column("status", sa.String),
    sa.column("options", sa.JSON),
    sa.column("fingerprint", sa.String),
    sa.column("run_id", sa.Integer),
    sa.column("after_job_id", sa.Integer),
    sa.column("worker", sa.String),
    sa.column("lease_until", sa.DateTime(timezone=True)),
    sa.column("error", sa.JSON),
    sa.column("finished_at", sa.DateTime(timezone=True)),
)
runs = sa.table(
    "runs",
    sa.column("id", sa.Integer),
    sa.column("status", sa.String),
    sa.column("error", sa.JSON),
    sa.column("finished_at", sa.DateTime(timezone=True)),
)


def upgrade() -> None:
    """Upgrade the schema."""
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("after_job_id", sa.Integer(), nullable=True))
        batch.create_foreign_key(
            op.f("fk_jobs_after_job_id_jobs"), "jobs", ["after_job_id"], ["id"], ondelete="CASCADE"
        )
        batch.create_index(op.f("ix_jobs_after_job_id"), ["after_job_id"], unique=False)
        batch.create_check_constraint(op.f("ck_jobs_kind"), "kind IN ('index', 'analysis')")
        batch.create_check_constraint(
            op.f("ck_jobs_status"), "status IN ('queued', 'running', 'done', 'failed')"
        )
    connection = op.get_bind()
    _move_after_into_its_column(connection)
    _fail_duplicates(connection)
    op.create_index(
        "uq_jobs_active_fingerprint",
        "jobs",
        ["fingerprint"],
        unique=True,
        sqlite_where=sa.text(ACTIVE),
        postgresql_where=sa.text(ACTIVE),
    )
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("attempts", sa.Integer(), server_default="0", nullable=False))
        batch.create_check_constraint(op.f("ck_shards_status"), "status IN ('pending', 'running', 'done')")


def downgrade() -> None:
    """Downgrade the schema."""
    with op.batch_alter_table("shards") as batch:
        batch.drop_constraint(op.f("ck_shards_status"), type_="check")
        batch.drop_column("attempts")
    op.drop_index("uq_jobs_active_fingerprint", table_name="jobs")
    connection = op.get_bind()
    rows = connection.execute(
        sa.select(jobs.c.id, jobs.c.options, jobs.c.run_id, jobs.c.after_job_id).where(
            jobs.c.kind == "analysis"
        )
    ).all()
    for row in rows:
        target = {"run": row.run_id} if row.run_id is not None else {"after": row.after_job_id}
        connection.execute(sa.update(jobs).where(jobs.c.id == row.id).values(options=target | row.options))
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(op.f("ck_jobs_status"), type_="check")
        batch.drop_constraint(op.f("ck_jobs_kind"), type_="check")
        batch.drop_index(op.f("ix_jobs_after_job_id"))
        batch.drop_constraint(op.f("fk_jobs_after_job_id_jobs"), type_="foreignkey")
        batch.drop_column("after_job_id")


def _move_after_into_its_column(connection) -> None:
    """options["after"] → after_job_id; options["run"] goes (run_id holds it); orphans are deleted."""
    existing = set(connection.scalars(sa.select(jobs.c.id)))
    rows = connection.execute(
        sa.select(jobs.c.id, jobs.c.options, jobs.c.run_id).where(jobs.c.kind == "analysis")
    ).all()
    for row in rows:
        options = dict(row.options or {})
        after = options.pop("after", None)
        options.pop("run", None)
        if row.run_id is None and after not in existing:  # it waits for a job that is gone: never runs
            connection.execute(sa.delete(jobs).where(jobs.c.id == row.id))
            continue
        waits_for = after if row.run_id is None else None
        connection.execute(
            sa.update(jobs).where(jobs.c.id == row.id).values(options=options, after_job_id=waits_for)
        )


def _fail_duplicates(connection) -> None:
    """Of several unfinished jobs with one fingerprint the oldest stays; the others fail, saying why."""
    rows = connection.execute(
        sa.select(jobs.c.id, jobs.c.fingerprint, jobs.c.run_id)
        .where(jobs.c.status.in_(("queued", "running")))
        .order_by(jobs.c.id)
    ).all()
    kept: dict[str, int] = {}
    moment = datetime.now(timezone.utc)
    for row in rows:
        if row.fingerprint not in kept:
            kept[row.fingerprint] = row.id
            continue
        error = {
            "type": "DuplicateJob",
            "message": f"job {kept[row.fingerprint]} has the same options and was queued first; "
            "one unfinished job per options is kept (migration 0006)",
            "traceback": "",
        }
        connection.execute(
            sa.update(jobs)
            .where(jobs.c.id == row.id)
            .values(status="failed", error=error, finished_at=moment, worker=None, lease_until=None)
        )
        if row.run_id is not None:
            connection.execute(
                sa.update(runs)
                .where(runs.c.id == row.run_id, runs.c.status == "running")
                .values(status="failed", error=error, finished_at=moment)
            )
