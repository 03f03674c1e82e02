"""One row a memory for its neighbours and for its links: `neighbours` keeps both kinds in `by_key` and
`by_value`, `memory_links` both directions in `inbound` and `outbound` (each memory_lists.SCORED_MEMORY
records, as `data` held them; NULL where a memory has none that way). A row a memory and kind cost its
key columns, the row's header and a primary-key entry twice: ~90 bytes a memory on Postgres for each
table, at 8B's 458,752 memories the difference between over and under 8 KB a memory.

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0025"
down_revision: str | Sequence[str] | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# table → (the column that told the lists apart, its width, {its value: the column that holds it now})
TABLES = {
    "neighbours": ("kind", 8, {"key": "by_key", "value": "by_value"}),
    "memory_links": ("direction", 3, {"in": "inbound", "out": "outbound"}),
}
MEMORY = ("run_id", "layer", "key")


def upgrade() -> None:
    for table, (told_by, _, columns) in TABLES.items():
        _rebuild(table, [sa.Column(c, sa.LargeBinary(), nullable=True) for c in columns.values()])
        joins = " ".join(
            f"LEFT JOIN {table} {c} ON {c}.run_id = m.run_id AND {c}.layer = m.layer AND {c}.key = m.key "
            f"AND {c}.{told_by} = '{value}'"
            for value, c in columns.items()
        )
        op.execute(
            f"INSERT INTO {table}_new (run_id, layer, key, {', '.join(columns.values())}) "
            f"SELECT m.run_id, m.layer, m.key, {', '.join(f'{c}.data' for c in columns.values())} "
            f"FROM (SELECT DISTINCT run_id, layer, key FROM {table}) m {joins}"
        )
        _replace(table)


def downgrade() -> None:
    for table, (told_by, width, columns) in TABLES.items():
        _rebuild(
            table, [sa.Column(told_by, sa.String(width), nullable=False), sa.Column("data", sa.LargeBinary())]
        )
        for value, c in columns.items():
            op.execute(
                f"INSERT INTO {table}_new (run_id, layer, key, {told_by}, data) "
                f"SELECT run_id, layer, key, '{value}', {c} FROM {table} WHERE {c} IS NOT NULL"
            )
        _replace(table)


def _rebuild(table: str, columns: list[sa.Column]) -> None:
    """`{table}_new`: a memory's key columns and these, keyed by the memory (and `kind` / `direction` when
    they are among them), its constraints named as `table`'s will be once it takes that name."""
    key = [*MEMORY, *(c.name for c in columns if c.name in ("kind", "direction"))]
    op.create_table(
        f"{table}_new",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.Integer(), nullable=False),
        *columns,
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=f"fk_{table}_new_run_id_runs", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint(*key, name=f"pk_{table}_new"),
    )


def _replace(table: str) -> None:
    """`{table}_new` takes the place and the constraint names of `table`."""
    op.drop_table(table)
    op.rename_table(f"{table}_new", table)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE {table} RENAME CONSTRAINT pk_{table}_new TO pk_{table}")
        op.execute(
            f"ALTER TABLE {table} RENAME CONSTRAINT fk_{table}_new_run_id_runs TO fk_{table}_run_id_runs"
        )
