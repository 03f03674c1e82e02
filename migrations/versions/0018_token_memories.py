"""Token search from a table computed at index time: `token_memories` (per run, readout and vocabulary
token, the memories whose value promotes and suppresses the token most, by logit and by probability;
ffmem.store.memory_lists packs them) replaces `run_arrays` (a run's value matrix and output embedding,
which the web process kept in memory and multiplied per query: 7.5 GB a run at Llama-3.1-8B's size).

The arrays of runs stored before this revision are dropped, not converted: those runs' token search
covers their stored top / bottom value tokens (as for runs stored before 0008) until they are indexed
again (`ffmem index … --again`), which computes the table.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | Sequence[str] | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "token_memories",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("readout", sa.String(length=8), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_token_memories_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "readout", "token_id", name=op.f("pk_token_memories")),
    )
    op.drop_table("run_arrays")


def downgrade() -> None:
    op.create_table(
        "run_arrays",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=40), nullable=False),
        sa.Column("part", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_arrays_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "name", "part", name=op.f("pk_run_arrays")),
    )
    op.drop_table("token_memories")
