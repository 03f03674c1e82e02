"""Shared fixtures: `db_url` (a freshly migrated SQLite file and Postgres database) and `session`.

Postgres is FFMEM_TEST_POSTGRES_URL or the local server's `test` database. Each pytest process works
in its own schema (ffmem_test_<pid>, dropped at the end) and its own databases (ffmem_test_<pid>_…, the
copies of a built index: its role needs CREATEDB), so concurrent test runs never clobber each other.
When Postgres cannot be reached its tests are skipped, except on CI (env CI set), where they fail: CI
must test Postgres.

A module's tests of the explorer index (`explorer_db`) run on SQLite alone unless the module marks
`pytest.mark.backends("sqlite", "postgres")`: the backend matters to the store, the queue and what
writes; tests/web/test_backend_parity.py holds every read-only page equal on both.
"""

from __future__ import annotations

import itertools
import os
import shutil
from contextlib import contextmanager

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs a pytest worker per core: one torch, OpenMP and numba thread each (set before torch is
    # imported; the processes a test starts inherit it), so that the workers do not fight over the cores.
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(variable, "1")

from sqlalchemy import create_engine, make_url, text  # noqa: E402

from ffmem.store.db import make_engine, make_sessionmaker, upgrade

# The fixture modules beside this file: the tiny random models, Playwright on Debian's Chromium, the tiny
# index and its explorer.
pytest_plugins = ["tiny_models", "browser_fixtures", "explorer_index"]

POSTGRES_URL = os.environ.get("FFMEM_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _unusable(error: Exception):
    """Skip (fail on CI) the test that needed the test Postgres, which `error` says is unusable."""
    reason = str(error).strip().splitlines()[0]
    message = f"Postgres at {POSTGRES_URL} unusable ({reason}); start it or set FFMEM_TEST_POSTGRES_URL"
    if os.environ.get("CI"):
        pytest.fail(f"CI must test Postgres: {message}", pytrace=False)
    pytest.skip(message)


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
        _unusable(error)
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


class PostgresDatabases:
    """Databases of this test process on the test Postgres server: `create(label)` makes an empty one (or a
    copy of `template`, a database nobody is connected to) and returns its URL; all are dropped at close."""

    def __init__(self) -> None:
        self.admin = create_engine(
            POSTGRES_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
        )
        self.names: list[str] = []
        self.numbers = itertools.count()

    def create(self, label: str, template: str | None = None) -> str:
        name = f"ffmem_test_{os.getpid()}_{label}_{next(self.numbers)}"
        copy = f' TEMPLATE "{make_url(template).database}"' if template else ""
        try:
            with self.admin.connect() as connection:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
                connection.execute(text(f'CREATE DATABASE "{name}"{copy}'))
        except Exception as error:  # noqa: BLE001 - any failure means "not usable"
            _unusable(error)
        self.names.append(name)
        return make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)

    def drop(self, url: str) -> None:
        self._drop(make_url(url).database)

    def _drop(self, name: str) -> None:
        with self.admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        self.names.remove(name)

    def close(self) -> None:
        for name in list(self.names):
            self._drop(name)
        self.admin.dispose()


@pytest.fixture(scope="session")
def postgres_databases():
    """This test process's own Postgres databases (PostgresDatabases), dropped after the session."""
    databases = PostgresDatabases()
    yield databases
    databases.close()


@contextmanager
def copy_database(source: str, folder, databases: PostgresDatabases):
    """A copy of the database at `source` (nobody connected to it): a file in `folder` for SQLite, a
    database made from it as a template on Postgres; yields its URL and removes it afterwards."""
    if source.startswith("sqlite"):
        target = folder / "ffmem.db"
        shutil.copyfile(make_url(source).database, target)
        yield f"sqlite:///{target}"
        return
    url = databases.create("copy", template=source)
    try:
        yield url
    finally:
        databases.drop(url)


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


@pytest.fixture(scope="session")
def migrated_template(tmp_path_factory, postgres_databases):
    """`template(backend)`: the URL of an empty database migrated to head, once per backend and test process
    (a SQLite file; a Postgres database), that `db_url` copies for each test: a copy takes milliseconds,
    Alembic's upgrade a third of a second."""
    built: dict[str, str] = {}

    def template(backend: str) -> str:
        if backend not in built:
            folder = tmp_path_factory.mktemp(f"migrated-{backend}")
            url = (
                f"sqlite:///{folder / 'template.db'}"
                if backend == "sqlite"
                else postgres_databases.create("migrated")
            )
            upgrade(url)
            built[backend] = url
        return built[backend]

    return template


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path, migrated_template, postgres_databases):
    """URL of an empty database migrated to head, on each backend: the test's own copy of the process's
    migrated template."""
    with copy_database(migrated_template(request.param), tmp_path, postgres_databases) as url:
        yield url


@pytest.fixture
def session(db_url):
    """A session on the freshly migrated database; the engine is disposed afterwards."""
    engine = make_engine(db_url)
    with make_sessionmaker(engine)() as session:
        yield session
    engine.dispose()


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "backends(*names): the backends a module's explorer_db runs on (default: sqlite alone)"
    )


def pytest_generate_tests(metafunc) -> None:
    """`explorer_db` on the backends the module's `backends` mark names, SQLite alone by default."""
    if "explorer_db" in metafunc.fixturenames:
        mark = metafunc.definition.get_closest_marker("backends")
        backends = list(mark.args) if mark else ["sqlite"]
        metafunc.parametrize("explorer_db", backends, indirect=True, scope="module")


def pytest_collection_modifyitems(items) -> None:
    """Every browser test is slow (a Chromium per module, pages served on a thread). The real model's tests
    come first, then the slow ones: `make test`'s workers take whole modules in this order (pytest-xdist's
    loadscope, not reordered), so the longest start at once and the workers end together."""
    for item in items:
        if "browser" in item.path.parts:
            item.add_marker(pytest.mark.slow)

    def weight(item) -> int:
        return 0 if item.get_closest_marker("smollm2") else 1 if item.get_closest_marker("slow") else 2

    items.sort(key=weight)  # stable: a module's tests stay together and in order


@pytest.fixture
def compile_backend(monkeypatch):
    """torch.compile's backend for the torch fold's compiled passes in a test: aot_eager (the graph dynamo
    traces, run without generating code: seconds) unless FFMEM_TEST_COMPILE_BACKEND says another. The
    option's own backend, inductor, generates code for a minute on a cold cache; its parity with the CPU
    fold is checked with FFMEM_TEST_COMPILE_BACKEND=inductor."""
    from ffmem.engine.mining import fold_passes

    monkeypatch.setattr(fold_passes, "BACKEND", os.environ.get("FFMEM_TEST_COMPILE_BACKEND", "aot_eager"))
