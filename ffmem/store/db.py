"""Engines, sessions and migrations. SQLite gets WAL and enforced foreign keys; Postgres a pre-ping pool,
and at start a few tries (with `tenacity`) while the server does not answer yet (`Retry`). `Session` is
the type the web's page builders take and pass on to the store (they import no SQLAlchemy)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import orjson
from alembic import command
from alembic.config import Config
from alembic.util import CommandError
from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError
from sqlalchemy.orm import Session, sessionmaker
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from ffmem.config import Settings
from ffmem.engine.errors import FfmemError

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"
SQLITE_PAGE_SIZE = 16384  # a new SQLite database's page size (see _sqlite_engine)
# A server that answers with one of these is coming or going: worth another try. Any other answer
# (a refused login, a missing database) fails at once.
TRANSIENT = (
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "sorry, too many clients already",
)
log = logging.getLogger("ffmem")


class DatabaseError(FfmemError):
    """The database cannot be opened, reached or migrated; the message says what to do."""


@dataclass(frozen=True)
class Retry:
    """How long to wait for a Postgres that does not answer: `attempts` tries, the waits between them
    doubling from `wait` to at most `wait_max` seconds. One try (the default) fails at once."""

    attempts: int = 1
    wait: float = 0.5
    wait_max: float = 4.0

    @classmethod
    def from_settings(cls, settings: Settings) -> Retry:
        return cls(settings.db_connect_attempts, settings.db_connect_wait, settings.db_connect_wait_max)


def make_engine(url: str, retry: Retry | None = None) -> Engine:
    """An engine for `url`, checked by connecting (Postgres: as `retry` says); raises DatabaseError with
    a remedy if that fails. A bad URL, a missing driver or a refused login fail at once."""
    parsed = _parse(url)
    if parsed.get_backend_name() == "sqlite":
        engine = _sqlite_engine(parsed)
    else:
        connect_args = {} if "connect_timeout" in parsed.query else {"connect_timeout": 10}
        try:
            engine = create_engine(
                parsed,
                pool_pre_ping=True,
                connect_args=connect_args,
                json_serializer=json_dumps,
                json_deserializer=_json_loads,
            )
        except (NoSuchModuleError, ModuleNotFoundError) as error:
            raise DatabaseError(
                f"no driver for {_shown(parsed)} ({error}); for Postgres install the extra: "
                "pip install 'ffmem[postgres]' and use a postgresql+psycopg:// URL"
            ) from None
    _check(engine, retry or Retry())
    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions bound to `engine`; objects stay readable after commit."""
    return sessionmaker(engine, expire_on_commit=False)


def upgrade(url: str, retry: Retry | None = None) -> None:
    """Create or migrate the database at `url` to the latest schema (Alembic head); Postgres is waited
    for as `retry` says."""
    engine = make_engine(url, retry)
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


def json_dumps(value) -> str:
    """JSON columns as written: without the spaces after separators (a key's histogram, a sentence's token
    ids and offsets, an explanation's token table: 10–20 % of their bytes), NaN and Infinity kept. One
    encoder for all (json.dumps with separators makes one a call: a third of a small value's time)."""
    return _ENCODER.encode(value)


_ENCODER = json.JSONEncoder(separators=(",", ":"))  # json.dumps(value, separators=(",", ":"))


def _json_loads(text: str | bytes):
    """JSON columns as read: orjson (a key page reads ~50 sentences' token ids and offsets; the standard
    library's decoder took an eighth of its time), and the standard library for what only it reads: the
    NaN and Infinity that json.dumps writes."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


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
    engine = create_engine(url, json_serializer=json_dumps, json_deserializer=_json_loads)

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        # 16 KiB pages for a new database (an existing one keeps its own): a key's examples row (~2.3 KB
        # on the whole default corpus) left most of a 4 KiB page empty, 9.7 KB a key in all; 8.0 KB so.
        cursor.execute(f"PRAGMA page_size={SQLITE_PAGE_SIZE}")
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


def _check(engine: Engine, retry: Retry) -> None:
    """Connect once; while Postgres does not answer, again as `retry` says, logging each wait."""
    attempts = 1 if engine.url.get_backend_name() == "sqlite" else retry.attempts
    retrying = Retrying(
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=retry.wait, max=retry.wait_max),
        retry=retry_if_exception(_not_answering),
        before_sleep=lambda state: _log_retry(engine.url, state, attempts),
        reraise=True,
    )
    try:
        for attempt in retrying:
            with attempt, engine.connect():
                pass
    except DBAPIError as error:
        engine.dispose()
        raise _unreachable(engine.url, error, attempts if _not_answering(error) else 1) from None


def _not_answering(error: BaseException) -> bool:
    """Whether `error` says the server did not answer (or is starting): not a refused login, say."""
    if not isinstance(error, DBAPIError):
        return False
    text = str(error.orig)
    return "FATAL:" not in text or any(transient in text for transient in TRANSIENT)


def _log_retry(url: URL, state: RetryCallState, attempts: int) -> None:
    error = state.outcome.exception() if state.outcome else None
    reason = _reason(error) if isinstance(error, DBAPIError) else str(error)
    reason = reason.rsplit("failed: ", 1)[-1]  # libpq's "connection to server at …, port … failed: X"
    sleep = state.next_action.sleep if state.next_action else 0.0
    log.warning(
        "Postgres at %s:%s/%s is not answering (%s); retrying in %g s (attempt %d of %d)",
        url.host,
        url.port or 5432,
        url.database,
        reason,
        sleep,
        state.attempt_number,
        attempts,
    )


def _reason(error: DBAPIError) -> str:
    return str(error.orig).strip().splitlines()[0] if error.orig is not None else str(error)


def _unreachable(url: URL, error: DBAPIError, attempts: int = 1) -> DatabaseError:
    reason = _reason(error)
    if attempts > 1:
        reason += f" (tried {attempts} times; FFMEM_DB_CONNECT_ATTEMPTS sets how many)"
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
