"""Engines, sessions and migrations. SQLite gets WAL and enforced foreign keys; Postgres a pre-ping pool."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.util import CommandError
from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError
from sqlalchemy.orm import Session, sessionmaker

from engine.errors import FfmemError

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"


class DatabaseError(FfmemError):
    """The database cannot be opened, reached or migrated; the message says what to do."""


def make_engine(url: str) -> Engine:
    """An engine for `url`, checked by connecting once; raises DatabaseError with a remedy if that fails."""
    parsed = _parse(url)
    if parsed.get_backend_name() == "sqlite":
        engine = _sqlite_engine(parsed)
    else:
        connect_args = {} if "connect_timeout" in parsed.query else {"connect_timeout": 10}
        try:
            engine = create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)
        except (NoSuchModuleError, ModuleNotFoundError) as error:
            raise DatabaseError(
                f"no driver for {_shown(parsed)} ({error}); for Postgres install the extra: "
                "pip install 'ffmem[postgres]' and use a postgresql+psycopg:// URL"
            ) from None
    _check(engine)
    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions bound to `engine`; objects stay readable after commit."""
    return sessionmaker(engine, expire_on_commit=False)


def upgrade(url: str) -> None:
    """Create or migrate the database at `url` to the latest schema (Alembic head)."""
    engine = make_engine(url)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    try:
        with engine.connect() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
            connection.commit()
    except CommandError as error:
        raise DatabaseError(
            f"cannot migrate {_shown(engine.url)}: {error}. The database may have been created by a newer "
            "ffmem: upgrade ffmem, or point FFMEM_DATABASE_URL (--db) at another database"
        ) from None
    except DBAPIError as error:
        raise _unreachable(engine.url, error) from None
    finally:
        engine.dispose()


def _sqlite_engine(url: URL) -> Engine:
    database = url.database or ""
    if database and database != ":memory:" and not database.startswith("file:"):
        folder = Path(database).expanduser().parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise DatabaseError(
                f"cannot create the folder {folder} for the database {database}: {error.strerror}. "
                "Choose a writable path with FFMEM_DATABASE_URL (--db), e.g. sqlite:///data/ffmem.db"
            ) from None
    engine = create_engine(url)

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    return engine


def _parse(url: str) -> URL:
    try:
        return make_url(url)
    except ArgumentError:
        raise DatabaseError(
            f"{url!r} is not a database URL; use sqlite:///data/ffmem.db or "
            "postgresql+psycopg://user@host:5432/dbname"
        ) from None


def _check(engine: Engine) -> None:
    try:
        with engine.connect():
            pass
    except DBAPIError as error:
        engine.dispose()
        raise _unreachable(engine.url, error) from None


def _unreachable(url: URL, error: DBAPIError) -> DatabaseError:
    reason = str(error.orig).strip().splitlines()[0] if error.orig is not None else str(error)
    if url.get_backend_name() == "sqlite":
        remedy = "Check that the folder exists and is writable, or point FFMEM_DATABASE_URL (--db) elsewhere"
    else:
        remedy = (
            "Is the server running and the URL right? Start it (e.g. `docker compose up -d postgres`), fix "
            "FFMEM_DATABASE_URL (--db), or use a local file: --db sqlite:///data/ffmem.db"
        )
    return DatabaseError(f"cannot open the database at {_shown(url)}: {reason}. {remedy}")


def _shown(url: URL) -> str:
    return url.render_as_string(hide_password=True)
