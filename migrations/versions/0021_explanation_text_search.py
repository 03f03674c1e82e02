"""Explanations found by a piece of their text through an index, not a scan of the run's explanations
(917,504 of them with two runs of an 8B model: 141 ms a query): on SQLite a full-text table over their text
with the trigram tokenizer (FTS5, SQLite ≥ 3.34), kept in step with `explanations` by triggers; on Postgres
a trigram index (pg_trgm) on lower(text), which `LIKE '%…%'` uses. Where neither can be made (an SQLite
without FTS5's trigram tokenizer, a Postgres role that may not create the extension) nothing is made and
the search scans, as before (ffmem.store.composition.search_explanations).

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | Sequence[str] | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FTS = "explanation_text"  # ffmem.store.composition.EXPLANATION_TEXT
SQLITE = (
    f"CREATE VIRTUAL TABLE {FTS} USING fts5(text, content='explanations', content_rowid='rowid', "
    "tokenize='trigram')",
    f"CREATE TRIGGER {FTS}_insert AFTER INSERT ON explanations BEGIN "
    f"INSERT INTO {FTS}(rowid, text) VALUES (new.rowid, new.text); END",
    f"CREATE TRIGGER {FTS}_delete AFTER DELETE ON explanations BEGIN "
    f"INSERT INTO {FTS}({FTS}, rowid, text) VALUES ('delete', old.rowid, old.text); END",
    f"CREATE TRIGGER {FTS}_update AFTER UPDATE OF text ON explanations BEGIN "
    f"INSERT INTO {FTS}({FTS}, rowid, text) VALUES ('delete', old.rowid, old.text); "
    f"INSERT INTO {FTS}(rowid, text) VALUES (new.rowid, new.text); END",
    f"INSERT INTO {FTS}({FTS}) VALUES ('rebuild')",  # the explanations stored before
)
POSTGRES_INDEX = "ix_explanations_text_trigram"
# Where pg_trgm goes: public (shared by every schema of the database, as extensions usually are), else
# the first schema of the search_path.
PLACES = (" WITH SCHEMA public", "")


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        if _sqlite_has_trigram(bind):
            for statement in SQLITE:
                op.execute(statement)
    elif bind.dialect.name == "postgresql":
        if not any(_created(bind, f"CREATE EXTENSION IF NOT EXISTS pg_trgm{where}") for where in PLACES):
            return  # a role that may not create the extension: no index
        schema = bind.scalar(
            sa.text(
                "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace "
                "WHERE e.extname = 'pg_trgm'"
            )
        )
        operators = f'"{schema}".gin_trgm_ops'  # whatever the search_path, the extension's own schema
        op.execute(f"CREATE INDEX {POSTGRES_INDEX} ON explanations USING gin (lower(text) {operators})")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        for name in ("insert", "delete", "update"):
            op.execute(f"DROP TRIGGER IF EXISTS {FTS}_{name}")
        op.execute(f"DROP TABLE IF EXISTS {FTS}")
    elif bind.dialect.name == "postgresql":
        op.execute(f"DROP INDEX IF EXISTS {POSTGRES_INDEX}")


def _created(bind, statement: str) -> bool:
    """Run `statement` in a savepoint: False (and nothing changed) where the database refuses it."""
    savepoint = bind.begin_nested()
    try:
        bind.execute(sa.text(statement))
    except sa.exc.DBAPIError:
        savepoint.rollback()
        return False
    savepoint.commit()
    return True


def _sqlite_has_trigram(bind) -> bool:
    """Whether this SQLite builds FTS5 tables with the trigram tokenizer (FTS5 compiled in, ≥ 3.34)."""
    try:
        bind.execute(
            sa.text("CREATE VIRTUAL TABLE temp.ffmem_trigram_probe USING fts5(x, tokenize='trigram')")
        )
    except sa.exc.OperationalError:
        return False
    bind.execute(sa.text("DROP TABLE temp.ffmem_trigram_probe"))
    return True
