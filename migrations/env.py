"""Alembic environment: migrates the connection ffmem.store.db.upgrade passes in, or the URL given to
`alembic`.

URL order: config.attributes["connection"] (ffmem.store.db.upgrade), config.attributes["url"], `-x url=...`,
sqlalchemy.url in alembic.ini, then ffmem's settings (FFMEM_DATABASE_URL).
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection

from ffmem.store.models import Base

config = context.config
target_metadata = Base.metadata
MIGRATION_LOCK = 0x66666D656D  # pg advisory lock id ("ffmem"): concurrent upgrades run one at a time

if config.config_file_name is not None and "connection" not in config.attributes:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url")
    if url:
        return url
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from ffmem.config import get_settings

    return get_settings().database_url


def run_migrations_offline() -> None:
    """Emit the migration SQL (`alembic upgrade head --sql`) without a database."""
    url = _url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def _migrate(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # Batch mode rebuilds tables; with foreign keys on, dropping the old table would cascade.
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
        connection.commit()
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=sqlite)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
        context.run_migrations()
    if connection.in_transaction():
        connection.commit()
    if sqlite:
        broken = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
        connection.exec_driver_sql("PRAGMA foreign_keys=ON")
        connection.commit()
        if broken:
            raise RuntimeError(f"migration left rows with dangling foreign keys: {broken[:5]}")


def run_migrations_online() -> None:
    """Migrate a live database: the connection passed in, or one opened from the URL."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _migrate(connection)
        return
    from ffmem.store.db import make_engine

    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _migrate(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
