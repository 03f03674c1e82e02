"""An explanation's pattern as packed bytes: `explanations.token_table` (ffmem.store.composition.TOKEN_TABLE:
the sign, then the token ids and their weights, then the (previous token, token) pairs and theirs), ~700
bytes where the same table as JSON took ~1,300 at a 128K-token vocabulary. `pattern` (JSON) becomes
nullable: runs explained before keep theirs there; new rows write the table instead. On SQLite that
rebuilds the table, which drops revision 0021's full-text triggers: they are made again and the index
rebuilt (its rows follow the table's rowids, which the copy renumbers).

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | Sequence[str] | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


FTS = "explanation_text"  # revision 0021's full-text table over explanations.text (SQLite)
TRIGGERS = (
    f"CREATE TRIGGER {FTS}_insert AFTER INSERT ON explanations BEGIN "
    f"INSERT INTO {FTS}(rowid, text) VALUES (new.rowid, new.text); END",
    f"CREATE TRIGGER {FTS}_delete AFTER DELETE ON explanations BEGIN "
    f"INSERT INTO {FTS}({FTS}, rowid, text) VALUES ('delete', old.rowid, old.text); END",
    f"CREATE TRIGGER {FTS}_update AFTER UPDATE OF text ON explanations BEGIN "
    f"INSERT INTO {FTS}({FTS}, rowid, text) VALUES ('delete', old.rowid, old.text); "
    f"INSERT INTO {FTS}(rowid, text) VALUES (new.rowid, new.text); END",
    f"INSERT INTO {FTS}({FTS}) VALUES ('rebuild')",
)  # as revision 0021 made them


def upgrade() -> None:
    with op.batch_alter_table("explanations") as batch:
        batch.add_column(sa.Column("token_table", sa.LargeBinary(), nullable=True))
        batch.alter_column("pattern", existing_type=sa.JSON(), nullable=True)
    _full_text_again()


def downgrade() -> None:
    op.execute("DELETE FROM explanations WHERE pattern IS NULL")  # a table the older schema cannot hold
    with op.batch_alter_table("explanations") as batch:
        batch.alter_column("pattern", existing_type=sa.JSON(), nullable=False)
        batch.drop_column("token_table")
    _full_text_again()


def _full_text_again() -> None:
    """On SQLite, where revision 0021 made the full-text table: its triggers again, its rows rebuilt."""
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        return
    query = sa.text("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = :name")
    if bind.execute(query, {"name": FTS}).first() is None:
        return
    for name in ("insert", "delete", "update"):
        op.execute(f"DROP TRIGGER IF EXISTS {FTS}_{name}")
    for statement in TRIGGERS:
        op.execute(statement)
