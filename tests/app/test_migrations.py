"""The migrations build exactly ffmem.store.models' schema, on SQLite and Postgres, and re-running them
is a no-op."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from ffmem.store.db import MIGRATIONS, make_engine, upgrade
from ffmem.store.models import Base


def _head() -> str:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return ScriptDirectory.from_config(config).get_current_head()


def _schema(url: str) -> tuple[str | None, list[tuple[str, list, list]]]:
    engine = make_engine(url)
    with engine.connect() as connection:
        revision = MigrationContext.configure(connection).get_current_revision()
        inspector = inspect(connection)
        tables = [
            (
                name,
                [column["name"] for column in inspector.get_columns(name)],
                sorted(index["name"] for index in inspector.get_indexes(name)),
            )
            for name in sorted(inspector.get_table_names())
        ]
    engine.dispose()
    return revision, tables


def test_migrations_match_the_models(db_url):
    engine = make_engine(db_url)
    with engine.connect() as connection:
        options = {"compare_type": True, "compare_server_default": True}
        context = MigrationContext.configure(connection, opts=options)
        differences = compare_metadata(context, Base.metadata)
    engine.dispose()
    assert differences == []


def test_upgrade_reaches_head_and_twice_is_a_no_op(db_url):
    revision, tables = _schema(db_url)
    assert revision == _head()
    assert {name for name, _, _ in tables} == set(Base.metadata.tables) | {"alembic_version"}
    upgrade(db_url)
    assert _schema(db_url) == (revision, tables)
