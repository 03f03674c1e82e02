"""Shared fixtures: `db_url` (a freshly migrated SQLite file and Postgres database) and `session`.

Postgres is FFMEM_TEST_POSTGRES_URL or the local server's `test` database. Each pytest process works
in its own schema (ffmem_test_<pid>, dropped at the end), so concurrent test runs never clobber each
other. When Postgres cannot be reached its tests are skipped, except on CI (env CI set), where they
fail: CI must test Postgres.
"""

from __future__ import annotations

import os

import pytest
from sqlalchemy import create_engine, make_url, text

from ffmem.store.db import make_engine, make_sessionmaker, upgrade

POSTGRES_URL = os.environ.get("FFMEM_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def postgres_url():
    """URL of a private schema of the test Postgres (search_path set), dropped after the session."""
    schema = f"ffmem_test_{os.getpid()}"
    admin = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
    try:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    except Exception as error:  # noqa: BLE001 - any failure means "not usable"
        admin.dispose()
        reason = str(error).strip().splitlines()[0]
        message = f"Postgres at {POSTGRES_URL} unusable ({reason}); start it or set FFMEM_TEST_POSTGRES_URL"
        if os.environ.get("CI"):
            pytest.fail(f"CI must test Postgres: {message}", pytrace=False)
        pytest.skip(message)
    url = make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    yield url.render_as_string(hide_password=False)
    with admin.begin() as connection:
        connection.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    admin.dispose()


def _clean_postgres(url: str) -> None:
    """Drop every table of the test schema, alembic_version included."""
    engine = create_engine(url)
    with engine.begin() as connection:
        query = text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
        tables = connection.scalars(query).all()
        quote = connection.dialect.identifier_preparer.quote
        if tables:
            connection.execute(text(f"DROP TABLE {', '.join(quote(table) for table in tables)} CASCADE"))
    engine.dispose()


def migrated_url(request, folder) -> str:
    """URL of an empty database migrated to head on the backend `request.param` names: SQLite, a file in
    `folder`; Postgres, the test schema emptied."""
    if request.param == "sqlite":
        url = f"sqlite:///{folder / 'ffmem.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
        _clean_postgres(url)
    upgrade(url)
    return url


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path) -> str:
    """URL of an empty database migrated to head, on each backend."""
    return migrated_url(request, tmp_path)


@pytest.fixture
def session(db_url):
    """A session on the freshly migrated database; the engine is disposed afterwards."""
    engine = make_engine(db_url)
    with make_sessionmaker(engine)() as session:
        yield session
    engine.dispose()


def pytest_collection_modifyitems(items) -> None:
    """Every browser test is slow (a Chromium per module, pages served on a thread)."""
    for item in items:
        if "browser" in item.path.parts:
            item.add_marker(pytest.mark.slow)


from browser_fixtures import browser, dialogs, page, watched  # noqa: E402,F401  (Playwright on Debian's Chromium)
from explorer_index import client, db, explorer_db, run, slug  # noqa: E402,F401  (a tiny index, its explorer)
from tiny_models import tiny, tiny_model_dir  # noqa: E402,F401  (tiny random model fixtures)
