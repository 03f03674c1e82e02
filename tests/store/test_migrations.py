"""The migrations build exactly ffmem.store.models' schema, on SQLite and Postgres, and re-running them
is a no-op."""

from __future__ import annotations

import sqlite3
from datetime import datetime, timezone

import pytest
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, select, text

from ffmem.store.db import MIGRATIONS, SQLITE_PAGE_SIZE, make_engine, make_sessionmaker, upgrade
from ffmem.store.models import Base, Job, JobKind, JobStatus, MemoryList


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


def _modelled(name, type_, parent_names) -> bool:
    """Whether the models describe a database object: not the text search's (migration 0021: SQLite's FTS5
    table over explanations and the tables it keeps, Postgres's trigram index), which only SQL makes."""
    return not (name or "").startswith("explanation_text") and name != "ix_explanations_text_trigram"


def test_migrations_match_the_models(db_url):
    engine = make_engine(db_url)
    with engine.connect() as connection:
        options = {"compare_type": True, "compare_server_default": True, "include_name": _modelled}
        context = MigrationContext.configure(connection, opts=options)
        differences = compare_metadata(context, Base.metadata)
    engine.dispose()
    assert differences == []


def test_upgrade_reaches_head_and_twice_is_a_no_op(db_url):
    revision, tables = _schema(db_url)
    assert revision == _head()
    modelled = {name for name, _, _ in tables if _modelled(name, "table", {})}
    assert modelled == set(Base.metadata.tables) | {"alembic_version"}
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


def _old_run(connection) -> None:
    """A model, corpus and run as revision 0011 stores them (ids 1)."""
    import sqlalchemy as sa

    now = datetime.now(timezone.utc)
    models = sa.table(
        "language_models",
        *map(sa.column, ("id", "slug", "source", "revision", "architecture", "family", "n_layers", "n_keys")),
        *map(sa.column, ("d_model", "vocab_size", "activation", "gated", "created_at")),
    )
    connection.execute(sa.insert(models).values(
        id=1, slug="m", source="m", revision=None, architecture="A", family="llama", n_layers=2, n_keys=4,
        d_model=8, vocab_size=50, activation="silu", gated=True, created_at=now,
    ))  # fmt: skip
    corpora = sa.table("corpora", *map(sa.column, ("id", "name", "source", "source_sha256", "fingerprint")),
                       *map(sa.column, ("tokenizer", "max_tokens", "n_sentences", "n_tokens", "created_at")),
                       sa.column("skipped", sa.JSON))  # fmt: skip
    connection.execute(sa.insert(corpora).values(
        id=1, name="c", source="c", source_sha256="0", fingerprint="f", tokenizer="t", max_tokens=8,
        n_sentences=3, n_tokens=9, skipped={}, created_at=now,
    ))  # fmt: skip
    runs = sa.table(
        "runs",
        *map(sa.column, ("id", "model_id", "corpus_id", "status", "top_k", "n_value_tokens", "n_sentences")),
        *map(sa.column, ("n_tokens", "dtype", "device", "package_version", "started_at")),
        sa.column("provenance", sa.JSON),
        sa.column("histogram_edges", sa.JSON),
    )
    connection.execute(sa.insert(runs).values(
        id=1, model_id=1, corpus_id=1, status="done", top_k=3, n_value_tokens=2, n_sentences=3, n_tokens=9,
        dtype="float32", device="cpu", package_version="0", provenance={}, histogram_edges=[0.0, 1.0],
        started_at=now,
    ))  # fmt: skip


def test_0012_to_0015_pack_lists_examples_neighbours_and_links_and_unpack_them_again(empty_url):
    import math

    import numpy as np
    import sqlalchemy as sa

    from ffmem.store import composition, memory_reads, memory_search
    from ffmem.store.key_examples import BandSample, key_examples

    _migrate(empty_url, "0011")
    triggers = [  # layer, key, sign, rank, sentence_index, position, coefficient (float32-exact)
        (0, 0, 1, 0, 2, 5, 3.5), (0, 0, 1, 1, 0, 1, 2.25), (0, 0, 1, 2, 1, 0, 0.125),
        (0, 0, -1, 0, 1, 2, -4.5), (0, 0, -1, 1, 2, 1, -0.5), (1, 3, 1, 0, 70_000, 300, 1.0),
    ]  # fmt: skip
    log_z = {"raw": 3.0, "norm": -1.5}
    values = [  # layer, key, readout, direction, rank, token_id, logit; prob = exp(logit − log_z) in float32
        (layer, key, readout, direction, rank, token, logit)
        for layer, key in ((0, 0), (1, 3))
        for readout in ("raw", "norm")
        for direction, tokens, logits in ((1, (7, 3), (2.0, 1.0)), (-1, (49, 0), (-30.0, -29.5)))
        for rank, (token, logit) in enumerate(zip(tokens, logits, strict=True))
    ]
    old_triggers = sa.table("triggers", *map(sa.column, ("run_id", "layer", "key", "sign", "rank")),
                            *map(sa.column, ("sentence_index", "position", "coefficient")))  # fmt: skip
    old_values = sa.table("value_tokens", *map(sa.column, ("run_id", "layer", "key", "readout", "direction")),
                          *map(sa.column, ("rank", "token_id", "logit", "prob")))  # fmt: skip
    names = ("layer", "key", "sign", "rank", "sentence_index", "position", "coefficient")
    # Key 0 of layer 0 shades its first 2 positive triggers (sentences 2, 0), its first negative one (1)
    # and its 2 band samples (sentences 1, 0): 3 + 4 + 6 + 6 + 4 tokens, NaN where not mined.
    lengths = {0: 4, 1: 6, 2: 3}
    samples = [[0, 1, 3, -2.5], [5, 0, 2, 1.75]]
    rng = np.random.default_rng(0)
    shading = [rng.normal(0, 2, lengths[s]).astype(np.float16) for s in (2, 0, 1, 1, 0)]
    for sentence in shading:
        sentence[0] = np.nan
    old_sentences = sa.table(
        "sentences",
        *map(sa.column, ("corpus_id", "index", "text", "first_position")),
        *(sa.column(name, sa.JSON) for name in ("token_ids", "offsets")),
    )
    old_examples = sa.table(
        "key_examples",
        *map(sa.column, ("run_id", "layer", "key", "positive", "negative")),
        sa.column("shading", sa.LargeBinary),
        sa.column("samples", sa.JSON),
    )
    neighbours = {"key": [[1, 3, 0.812346], [0, 2, -0.25]], "value": [[0, 1, 0.5]]}
    old_neighbours = sa.table("neighbours", *map(sa.column, ("run_id", "layer", "key", "kind")),
                              sa.column("neighbours", sa.JSON))  # fmt: skip
    links = {"in": [[1, 3, 0.12346], [0, 1, -2.5]], "out": [[1, 2, 3.1416e-05]]}
    old_links = sa.table("memory_links", *map(sa.column, ("run_id", "layer", "key", "direction")),
                         sa.column("links", sa.JSON))  # fmt: skip
    engine = make_engine(empty_url)
    with engine.begin() as connection:
        _old_run(connection)
        connection.execute(sa.insert(old_links), [
            dict(run_id=1, layer=0, key=0, direction=direction, links=listed)
            for direction, listed in links.items()
        ])  # fmt: skip
        connection.execute(sa.insert(old_neighbours), [
            dict(run_id=1, layer=0, key=0, kind=kind, neighbours=listed)
            for kind, listed in neighbours.items()
        ])  # fmt: skip
        connection.execute(sa.insert(old_sentences), [
            dict(corpus_id=1, index=i, text="x" * n, token_ids=[1] * n, offsets=[[0, 1]] * n,
                 first_position=1)
            for i, n in lengths.items()
        ])  # fmt: skip
        connection.execute(sa.insert(old_examples).values(
            run_id=1, layer=0, key=0, positive=2, negative=1, samples=samples,
            shading=np.concatenate(shading).tobytes(),
        ))  # fmt: skip
        connection.execute(
            sa.insert(old_triggers), [dict(zip(names, t, strict=True), run_id=1) for t in triggers]
        )
        connection.execute(sa.insert(old_values), [
            dict(run_id=1, layer=layer, key=key, readout=readout, direction=direction, rank=rank,
                 token_id=token, logit=logit, prob=float(np.float32(math.exp(logit - log_z[readout]))))
            for layer, key, readout, direction, rank, token, logit in values
        ])  # fmt: skip
    _migrate(empty_url, "head")
    with make_sessionmaker(engine)() as session:
        found = [
            tuple(getattr(t, n) for n in names) for t in memory_reads.iter_triggers(session=session, run_id=1)
        ]
        assert found == sorted(triggers, key=lambda t: (t[0], t[1], t[2], t[3]))
        for layer, key, readout, direction, rank, token, logit in values:
            stored = memory_reads.get_value_tokens(
                session=session, run_id=1, layer=layer, key=key, readout=readout, direction=direction
            )[rank]
            assert (stored.token_id, stored.logit) == (token, logit)
            assert stored.prob == pytest.approx(math.exp(logit - log_z[readout]), rel=1e-6)  # float32's error
        assert memory_search.get_neighbours(session=session, run_id=1, layer=0, key=0) == neighbours
        found = composition.get_links(session=session, run_id=1, layer=0, key=0)
        assert {d: [[f.layer, f.key, f.score] for f in listed] for d, listed in found.items()} == links
        found = key_examples(session=session, run_id=1, layer=0, key=0)
        assert found.samples == [BandSample(*s) for s in samples] and (found.positive, found.negative) == (
            2,
            1,
        )
        steps = found.steps()
        for decoded, old, step in zip(found.shading([3, 4, 6, 6, 4]), shading, steps, strict=True):
            old = old.astype(np.float32)
            assert step == np.float32(np.nanmax(np.abs(old)) / 127)
            assert np.isnan(decoded[0]) and np.abs(decoded[1:] - old[1:]).max() <= step / 2 * (1 + 1e-6)
    _migrate(empty_url, "0011", down=True)
    with engine.connect() as connection:
        c = old_triggers.c
        rows = connection.execute(sa.select(*(c[n] for n in names)).order_by(c.layer, c.key, c.sign, c.rank))
        assert [tuple(row) for row in rows] == sorted(triggers, key=lambda t: (t[0], t[1], t[2], t[3]))
        c = old_values.c
        query = sa.select(c.layer, c.key, c.readout, c.direction, c.rank, c.token_id, c.logit, c.prob)
        found = {tuple(row[:5]): row[5:] for row in connection.execute(query)}
        assert len(found) == len(values)
        for layer, key, readout, direction, rank, token, logit in values:
            token_id, stored_logit, prob = found[layer, key, readout, direction, rank]
            assert (token_id, stored_logit) == (token, logit)
            assert prob == pytest.approx(math.exp(logit - log_z[readout]), rel=1e-6)
        c = old_links.c
        assert dict(connection.execute(sa.select(c.direction, c.links)).all()) == links
        c = old_neighbours.c
        assert dict(connection.execute(sa.select(c.kind, c.neighbours)).all()) == neighbours
        c = old_examples.c
        (stored,) = connection.execute(sa.select(c.samples, c.shading)).all()
        assert stored.samples == samples
        old = np.concatenate(shading).astype(np.float32)
        back = np.frombuffer(stored.shading, np.float16).astype(np.float32)
        assert np.array_equal(np.isnan(back), np.isnan(old))
        tolerance = np.repeat(steps, [3, 4, 6, 6, 4]) / 2 + np.abs(old) * 2.0**-11  # half a step, float16
        assert (np.abs(back - old)[~np.isnan(old)] <= tolerance[~np.isnan(old)] * (1 + 1e-6)).all()
        indexes = {
            i["name"] for name in ("triggers", "value_tokens") for i in inspect(connection).get_indexes(name)
        }
        assert indexes == {"ix_triggers_sentence", "ix_value_tokens_token"}
    engine.dispose()


def test_0016_adds_neighbour_baselines_and_downgrading_drops_them(empty_url):
    """Issue 26 (15): runs stored before 0016 keep their neighbours and simply have no baseline."""
    _migrate(empty_url, "0015")
    assert "neighbour_baselines" not in {name for name, _, _ in _schema(empty_url)[1]}
    _migrate(empty_url, "head")
    tables = dict((name, columns) for name, columns, _ in _schema(empty_url)[1])
    assert tables["neighbour_baselines"] == ["run_id", "layer", "kind", "pairs", "mean", "p99", "nearest"]
    _migrate(empty_url, "0015", down=True)
    revision, schema = _schema(empty_url)
    assert revision == "0015" and "neighbour_baselines" not in {name for name, _, _ in schema}
    assert "neighbours" in {name for name, _, _ in schema}


def test_0026_adds_the_nearest_neighbour_baseline_null_for_a_run_stored_before(empty_url):
    """Issue 39 (1): a baseline row stored before 0026 keeps its random-pair numbers and has no `nearest`
    (its related sections say the baseline is unknown); downgrading drops the column."""
    import sqlalchemy as sa

    _migrate(empty_url, "0025")
    engine = make_engine(empty_url)
    baselines = sa.table(
        "neighbour_baselines", *map(sa.column, ("run_id", "layer", "kind", "pairs", "mean", "p99"))
    )
    with engine.begin() as connection:
        _old_run(connection)
        connection.execute(
            sa.insert(baselines).values(run_id=1, layer=0, kind="value", pairs=9, mean=0.1, p99=0.3)
        )
    engine.dispose()
    _migrate(empty_url, "head")
    engine = make_engine(empty_url)
    with engine.connect() as connection:
        rows = connection.execute(sa.text("SELECT kind, pairs, mean, p99, nearest FROM neighbour_baselines"))
        assert rows.all() == [("value", 9, 0.1, 0.3, None)]
    engine.dispose()
    _migrate(empty_url, "0025", down=True)
    tables = dict((name, columns) for name, columns, _ in _schema(empty_url)[1])
    assert tables["neighbour_baselines"] == ["run_id", "layer", "kind", "pairs", "mean", "p99"]


def test_0027_adds_a_jobs_past_attempts_null_for_a_job_stored_before(empty_url):
    """Issue 39 (3): a job stored before 0027 has no past attempts (NULL: its first attempt, as far as
    known); downgrading drops the column."""
    import sqlalchemy as sa

    from ffmem.store.models import Job

    _migrate(empty_url, "0026")
    columns = ("kind", "status", "options", "fingerprint", "attempts", "created_at")
    engine = make_engine(empty_url)
    with engine.begin() as connection:
        connection.execute(
            sa.insert(sa.table("jobs", *map(sa.column, columns))).values(
                kind="index", status="failed", options="{}", fingerprint="f", attempts=1,
                created_at=datetime.now(timezone.utc),
            )
        )  # fmt: skip
    engine.dispose()
    _migrate(empty_url, "head")
    engine = make_engine(empty_url)
    with make_sessionmaker(engine)() as session:
        job = session.scalars(sa.select(Job)).one()
        assert (job.past_attempts, job.attempt) == (None, 1)
    engine.dispose()
    _migrate(empty_url, "0026", down=True)
    assert "past_attempts" not in dict((name, c) for name, c, _ in _schema(empty_url)[1])["jobs"]


def test_0028_allows_composition_jobs_and_downgrading_deletes_them(empty_url):
    """Issue 40 (2): `ffmem compose` queues a job of the kind "composition", which 0027 refuses; going
    back to 0027 deletes such jobs and refuses the kind again."""
    import sqlalchemy as sa
    from sqlalchemy.exc import IntegrityError

    columns = ("kind", "status", "options", "fingerprint", "attempts", "created_at")
    jobs = sa.table("jobs", *map(sa.column, columns))

    def insert(kind: str, fingerprint: str) -> None:
        engine = make_engine(empty_url)
        try:
            with engine.begin() as connection:
                connection.execute(
                    sa.insert(jobs).values(
                        kind=kind, status="done", options="{}", fingerprint=fingerprint, attempts=1,
                        created_at=datetime.now(timezone.utc),
                    )
                )  # fmt: skip
        finally:
            engine.dispose()

    _migrate(empty_url, "0027")
    with pytest.raises(IntegrityError):
        insert("composition", "a")
    _migrate(empty_url, "head")
    insert("composition", "b")
    insert("index", "c")
    _migrate(empty_url, "0027", down=True)
    engine = make_engine(empty_url)
    with engine.connect() as connection:
        assert connection.execute(sa.text("SELECT kind FROM jobs")).scalars().all() == ["index"]
    engine.dispose()
    with pytest.raises(IntegrityError):
        insert("composition", "d")


def test_0017_checks_a_runs_status_and_downgrading_drops_the_check(empty_url):
    """Issue 27: a run's status is one of RunStatus's values, checked like a job's and a shard's."""

    def checks(url: str) -> set[str]:
        engine = make_engine(url)
        with engine.connect() as connection:
            found = {check["name"] for check in inspect(connection).get_check_constraints("runs")}
        engine.dispose()
        return found

    _migrate(empty_url, "head")
    assert "ck_runs_status" in checks(empty_url)
    _migrate(empty_url, "0016", down=True)
    assert "ck_runs_status" not in checks(empty_url)


def test_0018_replaces_the_search_arrays_with_the_token_table_and_downgrading_brings_them_back_empty(
    empty_url,
):
    """Issue 29: token search reads a token → memories table; the value matrices of older runs go (their
    search covers the stored value tokens until they are indexed again)."""
    _migrate(empty_url, "0017")
    tables = {name for name, _, _ in _schema(empty_url)[1]}
    assert "run_arrays" in tables and "token_memories" not in tables
    _migrate(empty_url, "head")
    tables = dict((name, columns) for name, columns, _ in _schema(empty_url)[1])
    assert (
        tables["token_memories"] == ["run_id", "readout", "token_id", "data"] and "run_arrays" not in tables
    )
    _migrate(empty_url, "0017", down=True)
    revision, schema = _schema(empty_url)
    assert revision == "0017" and "token_memories" not in {name for name, _, _ in schema}
    assert "run_arrays" in {name for name, _, _ in schema}


def test_0019_indexes_an_older_runs_positive_triggers_by_sentence_as_the_worker_does(empty_url):
    """Issue 29: free-text search reads a sentence's triggers from `sentence_triggers`; a run stored before
    gets them from its trigger lists, packed as the index build packs them (memory_lists)."""
    import numpy as np
    import sqlalchemy as sa

    from ffmem.store import memory_lists

    _migrate(empty_url, "0018")
    triggers = {  # (layer, key, sign) → [(sentence, position, coefficient)], strongest first
        (0, 1, 1): [(2, 5, 3.5), (0, 1, 2.25)],
        (1, 3, 1): [(70_000, 300, 1.0), (2, 0, 0.5)],
        (1, 0, -1): [(2, 4, -9.0)],  # negative: not indexed
    }
    engine = make_engine(empty_url)
    with engine.begin() as connection:
        _old_run(connection)  # 2 layers × 4 keys
        lists = sa.table("memory_lists", *map(sa.column, ("run_id", "kind", "sign", "layer", "key", "data")))
        for (layer, key, sign), rows in triggers.items():
            blob = np.array(rows, memory_lists.TRIGGER).tobytes()  # as stored before 0031
            connection.execute(
                sa.insert(lists).values(run_id=1, kind="triggers", sign=sign, layer=layer, key=key, data=blob)
            )
    engine.dispose()
    _migrate(empty_url, "head")
    engine = make_engine(empty_url)
    with engine.connect() as connection:
        stored = dict(connection.execute(sa.text("SELECT sentence_index, data FROM sentence_triggers")).all())
    engine.dispose()
    positive = [
        (layer * 4 + key, *row) for (layer, key, sign), rows in triggers.items() if sign == 1 for row in rows
    ]
    memory, sentence, position, coefficient = (np.array(c) for c in zip(*positive, strict=True))
    sentences, blobs = memory_lists.encode_sentence_triggers(memory, sentence, position, coefficient)
    decoded = {s: memory_lists.decode_sentence_triggers(bytes(b)).tolist() for s, b in stored.items()}
    expected = zip(sentences, map(memory_lists.decode_sentence_triggers, blobs), strict=True)
    assert decoded == {s: entries.tolist() for s, entries in expected}
    assert memory_lists.decode_sentence_triggers(stored[2]).tolist() == [(1, 5, 3.5), (7, 0, 0.5)]
    assert sorted(stored) == [0, 2, 70_000]
    _migrate(empty_url, "0018", down=True)
    assert "sentence_triggers" not in {name for name, _, _ in _schema(empty_url)[1]}


def test_0023_packs_new_token_tables_keeps_old_patterns_and_their_text_search(empty_url):
    """Issue 30: an explanation's pattern is packed bytes from 0023 on; one stored before keeps its JSON,
    and free-text search finds both (SQLite: the full-text triggers survive the table's rebuild)."""
    import sqlalchemy as sa

    from ffmem.store import composition
    from ffmem.store.db import make_sessionmaker

    _migrate(empty_url, "0022")
    engine = make_engine(empty_url)
    old_pattern = {"final": [7], "ngram": [], "context": []}
    with engine.begin() as connection:
        _old_run(connection)
        columns = ("run_id", "layer", "key", "source", "text", "score")
        explanations = sa.table(
            "explanations", *map(sa.column, columns), *map(sa.column, ("pattern", "details"), [sa.JSON] * 2)
        )
        connection.execute(sa.insert(explanations).values(
            run_id=1, layer=0, key=1, source="heuristic", text="ends with Paris", score=0.5,
            pattern=old_pattern, details={"positions": 9},
        ))  # fmt: skip
    engine.dispose()
    _migrate(empty_url, "head")
    engine = make_engine(empty_url)
    table = {
        "sign": -1,
        "final": [3, 70_000],
        "weights": [1.25, -0.5],
        "pairs": [[3, 4]],
        "pair_weights": [2.5],
    }
    with make_sessionmaker(engine)() as session:
        rows = [(1, 2, "heuristic", "strongest at Parisian", 0.25, table, {"positions": 9})]
        composition.store_explanations(session=session, run_id=1, rows=rows)
        session.commit()
        old = composition.get_explanation(session=session, run_id=1, layer=0, key=1)
        new = composition.get_explanation(session=session, run_id=1, layer=1, key=2)
        assert composition.explanation_pattern(old) == old_pattern and old.token_table is None
        assert composition.explanation_pattern(new) == table and new.pattern is None
        # float16 weights from 0024 on; ids as wide as the largest (70,000: 3 bytes) from 0032 on
        assert len(new.token_table) == 5 + (3 + 2) * 2 + (2 * 3 + 2) * 1
        found = composition.search_explanations(session=session, run_id=1, text="paris", limit=5)
        assert sorted((e.layer, e.key) for e in found) == [(0, 1), (1, 2)]
    engine.dispose()
    _migrate(empty_url, "0022", down=True)  # the packed row cannot go back: it is dropped, the old one kept
    engine = make_engine(empty_url)
    with engine.connect() as connection:
        assert connection.execute(sa.text("SELECT layer, key FROM explanations")).all() == [(0, 1)]
    engine.dispose()


def test_0024_packs_token_tables_with_float16_weights_and_key_statistics_as_real_on_postgres(empty_url):
    """Issue 29: a token table stored at 0023 (float32 weights) is packed again with float16 weights, the
    bound of float16 where a weight exceeds it, and back on a downgrade; key_stats' statistics become
    4-byte reals on Postgres and keep their values to float32's precision."""
    import numpy as np
    import sqlalchemy as sa

    _migrate(empty_url, "0023")
    engine = make_engine(empty_url)
    weights, pair_weights = [1.25, -0.0547, 1e6], [2.5]
    old = b"".join(
        (
            np.array([(1, 3, 1)], [("sign", "i1"), ("tokens", "<u2"), ("pairs", "<u2")]).tobytes(),
            np.array([3, 70_000, 9], "<i4").tobytes(),
            np.array(weights, "<f4").tobytes(),
            np.array([[3, 4]], "<i4").tobytes(),
            np.array(pair_weights, "<f4").tobytes(),
        )
    )
    with engine.begin() as connection:
        _old_run(connection)
        columns = ("run_id", "layer", "key", "source", "text", "score", "token_table")
        explanations = sa.table("explanations", *map(sa.column, columns), sa.column("details", sa.JSON))
        connection.execute(sa.insert(explanations).values(
            run_id=1, layer=0, key=1, source="heuristic", text="ends with Paris", score=0.5, token_table=old,
            details={"positions": 9},
        ))  # fmt: skip
        columns = ("run_id", "layer", "key", "mean", "positive_share", "value_norm", "max_coefficient")
        stats = sa.table("key_stats", *map(sa.column, columns), sa.column("histogram", sa.JSON))
        connection.execute(sa.insert(stats).values(
            run_id=1, layer=0, key=1, mean=0.1, positive_share=1 / 3, value_norm=2.0, max_coefficient=None,
            histogram=[1, 2],
        ))  # fmt: skip
    engine.dispose()
    _migrate(empty_url, "0024")
    engine = make_engine(empty_url)
    with engine.connect() as connection:
        stored = bytes(connection.execute(sa.text("SELECT token_table FROM explanations")).scalar_one())
        mean, share = connection.execute(sa.text("SELECT mean, positive_share FROM key_stats")).one()
        types = {c["name"]: str(c["type"]) for c in inspect(connection).get_columns("key_stats")}
        compression = _compression(connection)
    engine.dispose()
    assert len(stored) == 5 + 6 * 3 + 10 * 1
    assert stored[:5] == old[:5] and stored[5:17] == old[5:17] and stored[23:31] == old[29:37]  # ids kept
    assert np.frombuffer(stored, "<f2", count=3, offset=17).tolist() == [1.25, np.float16(-0.0547), 65504.0]
    assert np.frombuffer(stored, "<f2", count=1, offset=31).tolist() == pair_weights
    if empty_url.startswith("postgresql"):
        assert types["mean"] == "REAL" and types["quadrant_nn"] == "REAL"
        assert compression == "l"  # lz4 (this server has it)
        assert (
            np.float32(mean) == np.float32(0.1) and np.float32(share) == np.float32(1 / 3) and share != 1 / 3
        )
    else:
        assert (mean, share) == (0.1, 1 / 3)
    _migrate(empty_url, "0023", down=True)
    engine = make_engine(empty_url)
    with engine.connect() as connection:
        back = bytes(connection.execute(sa.text("SELECT token_table FROM explanations")).scalar_one())
        types = {c["name"]: str(c["type"]) for c in inspect(connection).get_columns("key_stats")}
        compression = _compression(connection)
    engine.dispose()
    assert len(back) == len(old) and back[:17] == old[:17]
    assert np.frombuffer(back, "<f4", count=3, offset=17).tolist() == [
        1.25,
        float(np.float16(-0.0547)),
        65504.0,
    ]
    if empty_url.startswith("postgresql"):
        assert types["mean"] == "DOUBLE PRECISION" and compression == ""


def _compression(connection) -> str | None:
    """sentence_triggers.data's compression method on Postgres ("l": lz4, "": the default); None elsewhere."""
    if connection.dialect.name != "postgresql":
        return None
    query = (
        "SELECT attcompression FROM pg_attribute "
        "WHERE attrelid = 'sentence_triggers'::regclass AND attname = 'data'"
    )
    return connection.execute(text(query)).scalar_one()


def test_a_new_sqlite_database_has_16_kib_pages_and_an_old_one_keeps_its_own(tmp_path):
    """Large pages pack a key's examples row (~2.3 KB) with others: storage per key ≤ 8 KB on the whole
    default corpus (docs/benchmarks.md). A database made before keeps its 4 KiB pages, still in WAL mode."""
    new, old = tmp_path / "new.db", tmp_path / "old.db"
    sqlite3.connect(old).execute("CREATE TABLE t (x)").connection.close()  # 4 KiB pages
    for path, pages in ((new, SQLITE_PAGE_SIZE), (old, 4096)):
        upgrade(f"sqlite:///{path}")
        engine = make_engine(f"sqlite:///{path}")
        with engine.connect() as connection:
            assert connection.execute(text("PRAGMA page_size")).scalar() == pages
            assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        engine.dispose()


def test_json_columns_read_back_what_was_stored_nan_too(tmp_path):
    """JSON columns are written compact and read with orjson, and with the standard library where only it
    can: the NaN that json.dumps writes."""
    from ffmem.store.models import Corpus

    url = f"sqlite:///{tmp_path / 'json.db'}"
    upgrade(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    fields = dict(source="t", source_sha256="0", tokenizer="t", max_tokens=1, n_sentences=0, n_tokens=0)
    fields["created_at"] = datetime.now(timezone.utc)
    with sessions() as session:
        plain = Corpus(name="plain", fingerprint="1", skipped={"empty": 2, "é": [1, 2.5]}, **fields)
        odd = Corpus(name="odd", fingerprint="2", skipped={"nan": float("nan")}, **fields)
        session.add_all([plain, odd])
        session.commit()
        ids = plain.id, odd.id
    with sessions() as session:
        found = [session.get(Corpus, id).skipped for id in ids]
    assert found[0] == {"empty": 2, "é": [1, 2.5]}
    assert list(found[1]) == ["nan"] and found[1]["nan"] != found[1]["nan"]  # NaN
    with engine.connect() as connection:  # written without the spaces after separators
        stored = connection.exec_driver_sql("SELECT skipped FROM corpora ORDER BY id").scalars().all()
    assert stored == ['{"empty":2,"\\u00e9":[1,2.5]}', '{"nan":NaN}']
    engine.dispose()


def test_0030_adds_token_changes_and_downgrading_drops_them(empty_url):
    """Issue 42 (3): runs stored before 0030 have no TokenChange sample; downgrading drops the table."""
    _migrate(empty_url, "0028")
    assert "token_changes" not in {name for name, _, _ in _schema(empty_url)[1]}
    _migrate(empty_url, "head")
    tables = dict((name, columns) for name, columns, _ in _schema(empty_url)[1])
    assert tables["token_changes"] == [
        "run_id", "layer", "key", "contexts", "promoted", "suppressed", "overlap", "spearman", "control_key",
        "control_overlap", "control_spearman",
    ]  # fmt: skip
    _migrate(empty_url, "0028", down=True)
    revision, schema = _schema(empty_url)
    assert revision == "0028" and "token_changes" not in {name for name, _, _ in schema}


def test_0032_stores_list_kinds_as_numbers_and_downgrading_names_them_again(empty_url):
    """Issue 41: a memory list's kind is SMALLINT 1, 2, 3 ("norm", "raw", "triggers") from 0032 on; a run
    stored before reads its lists as before, and downgrading writes the names back."""
    import numpy as np
    import sqlalchemy as sa

    from ffmem.store import composition, memory_reads

    _migrate(empty_url, "0031")
    engine = make_engine(empty_url)
    stored = {("triggers", 1, 0, 1): b"t+", ("triggers", -1, 1, 3): b"t-", ("raw", 1, 0, 2): b"r"}
    stored |= {("norm", -1, 1, 0): b"n"}
    with engine.begin() as connection:
        _old_run(connection)
        lists = sa.table("memory_lists", *map(sa.column, ("run_id", "kind", "sign", "layer", "key", "data")))
        for (kind, sign, layer, key), data in stored.items():
            connection.execute(
                sa.insert(lists).values(run_id=1, kind=kind, sign=sign, layer=layer, key=key, data=data)
            )
    engine.dispose()
    _migrate(empty_url, "head")
    engine = make_engine(empty_url)
    with engine.connect() as connection:
        raw = connection.execute(
            sa.text("SELECT kind, layer, key FROM memory_lists ORDER BY kind, layer")
        ).all()
        assert raw == [(1, 1, 0), (2, 0, 2), (3, 0, 1), (3, 1, 3)]  # norm, raw, triggers
    with make_sessionmaker(engine)() as session:
        read = session.execute(select(MemoryList.kind, MemoryList.sign, MemoryList.layer, MemoryList.key,
                                      MemoryList.data)).all()  # fmt: skip
        assert {tuple(row[:4]): row[4] for row in read} == stored
        assert memory_reads._list(session, 1, "raw", 1, 0, 2) == b"r"  # the store's lookup of a list
        table = {
            "sign": 1,
            "final": [3, 300],
            "weights": [1.5, -0.5],
            "pairs": [[-1, 4]],
            "pair_weights": [2.0],
        }
        rows = [(1, 2, "heuristic", "ends with Paris", 0.5, table, {"positions": 9})]
        composition.store_explanations(session=session, run_id=1, rows=rows)
        session.commit()
        packed = composition.get_explanation(session=session, run_id=1, layer=1, key=2).token_table
        assert len(packed) == 5 + (2 + 2) * 2 + (2 * 2 + 2)  # ids in 2 bytes (300; −1 all ones)
    engine.dispose()
    _migrate(empty_url, "0031", down=True)
    engine = make_engine(empty_url)
    with engine.connect() as connection:
        back = connection.execute(sa.text("SELECT kind, sign, layer, key, data FROM memory_lists")).all()
        old = bytes(connection.scalar(sa.text("SELECT token_table FROM explanations")))
    engine.dispose()
    assert {tuple(row[:4]): bytes(row[4]) for row in back} == stored
    assert len(old) == 5 + 6 * 2 + 10 and composition.unpack_token_table(old) == table  # int32 ids again
    assert old[0] == 1 and np.frombuffer(old, "<i4", count=2, offset=5 + 8 + 4).tolist() == [-1, 4]
