"""Two runs side by side: `comparisons` (one per pair of runs, stored with the lower run id first: what
was compared and a summary per layer) and `key_changes` (per memory: the overlap of its top triggers,
the change of its statistics and, from the weights, the cosine of its key and of its value between the
two runs' models). A worker computes them as a job of the new kind "comparison".

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACTIVE = "status IN ('queued', 'running')"
# The page's sorts: each a rank column of key_changes with its index.
SORTS = (
    "change", "overlap", "key", "value", "mean", "positive_share", "max_coefficient", "min_coefficient",
    "density",
)  # fmt: skip


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
    """Upgrade the schema."""
    op.create_table(
        "comparisons",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_a", sa.Integer(), nullable=False),
        sa.Column("run_b", sa.Integer(), nullable=False),
        sa.Column("basis", sa.String(length=20), nullable=False),
        sa.Column("top_t", sa.Integer(), nullable=False),
        sa.Column("layers", sa.JSON(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_a"], ["runs.id"], name=op.f("fk_comparisons_run_a_runs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["run_b"], ["runs.id"], name=op.f("fk_comparisons_run_b_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_comparisons")),
        sa.UniqueConstraint("run_a", "run_b", name=op.f("uq_comparisons_run_a_run_b")),
    )
    op.create_index(op.f("ix_comparisons_run_b"), "comparisons", ["run_b"], unique=False)
    op.create_table(
        "key_changes",
        sa.Column("comparison_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.Integer(), nullable=False),
        sa.Column("overlap", sa.Float(), nullable=True),
        sa.Column("negative_overlap", sa.Float(), nullable=True),
        sa.Column("key_cosine", sa.Float(), nullable=False),
        sa.Column("gate_cosine", sa.Float(), nullable=True),
        sa.Column("up_cosine", sa.Float(), nullable=True),
        sa.Column("value_cosine", sa.Float(), nullable=False),
        sa.Column("moved", sa.Float(), nullable=False),
        sa.Column("d_mean", sa.Float(), nullable=True),
        sa.Column("d_positive_share", sa.Float(), nullable=True),
        sa.Column("d_max_coefficient", sa.Float(), nullable=True),
        sa.Column("d_min_coefficient", sa.Float(), nullable=True),
        sa.Column("d_density", sa.Float(), nullable=True),
        *(sa.Column(f"rank_{name}", sa.Integer(), nullable=False) for name in SORTS),
        sa.ForeignKeyConstraint(
            ["comparison_id"],
            ["comparisons.id"],
            name=op.f("fk_key_changes_comparison_id_comparisons"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("comparison_id", "layer", "key", name=op.f("pk_key_changes")),
    )
    for name in SORTS:
        op.create_index(f"ix_key_changes_rank_{name}", "key_changes", ["comparison_id", f"rank_{name}"])
    _job_kinds("'index', 'analysis', 'comparison'")


def downgrade() -> None:
    """Downgrade the schema (comparison jobs are deleted: the older schema has no such kind)."""
    op.execute(sa.text("DELETE FROM jobs WHERE kind = 'comparison'"))
    _job_kinds("'index', 'analysis'")
    for name in SORTS:
        op.drop_index(f"ix_key_changes_rank_{name}", table_name="key_changes")
    op.drop_table("key_changes")
    op.drop_index(op.f("ix_comparisons_run_b"), table_name="comparisons")
    op.drop_table("comparisons")
