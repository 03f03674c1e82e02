"""The migrations build exactly ffmem.store.models' schema, on SQLite and Postgres, and re-running them
is a no-op."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, select

from ffmem.store.db import MIGRATIONS, make_engine, make_sessionmaker, upgrade
from ffmem.store.models import Base, Job, JobKind, JobStatus


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


def _migrate(url: str, revision: str, down: bool = False) -> None:
    from alembic import command

    engine = make_engine(url)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.connect() as connection:
        config.attributes["connection"] = connection
        (command.downgrade if down else command.upgrade)(config, revision)
        connection.commit()
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'old.db'}"
    from conftest import _clean_postgres

    url = request.getfixturevalue("postgres_url")
    _clean_postgres(url)
    return url


def test_0006_moves_the_wait_into_a_foreign_key_and_keeps_one_unfinished_job_per_options(empty_url):
    import sqlalchemy as sa

    _migrate(empty_url, "0005")
    plain = ("id", "kind", "status", "fingerprint", "attempts", "created_at")
    jobs = sa.table(
        "jobs", *map(sa.column, plain), sa.column("options", sa.JSON), sa.column("error", sa.JSON)
    )
    rows = [
        (1, "index", "queued", "A", {"model": "m"}),
        (2, "analysis", "queued", "B", {"after": 1, "examples": 5}),  # waits for job 1
        (3, "analysis", "queued", "C", {"after": 99, "examples": 5}),  # waits for a job that is gone
        (4, "index", "running", "A", {"model": "m"}),  # raced job 1: the same options
        (5, "index", "done", "A", {"model": "m"}),
    ]
    engine = make_engine(empty_url)
    with engine.begin() as connection:
        for id, kind, status, key, options in rows:
            values = dict(id=id, kind=kind, status=status, fingerprint=key, options=options, attempts=0)
            connection.execute(sa.insert(jobs).values(**values, created_at=datetime.now(timezone.utc)))
    _migrate(empty_url, "head")
    with make_sessionmaker(engine)() as session:
        found = {job.id: job for job in session.scalars(select(Job))}
        assert sorted(found) == [1, 2, 4, 5]  # 3 could never run
        assert (found[2].after_job_id, found[2].options, found[2].kind) == (
            1,
            {"examples": 5},
            JobKind.analysis,
        )
        assert [found[n].status for n in (1, 4, 5)] == [JobStatus.queued, JobStatus.failed, JobStatus.done]
        assert found[4].error["message"] == (
            "job 1 has the same options and was queued first; one unfinished job per options is kept "
            "(migration 0006)"
        )
    _migrate(empty_url, "0005", down=True)
    with engine.connect() as connection:
        assert connection.execute(sa.select(jobs.c.options).where(jobs.c.id == 2)).scalar() == {
            "after": 1, "examples": 5,
        }  # fmt: skip
    engine.dispose()
