"""`ffmem import FOLDER`: an export loaded into another database — SQLite into Postgres and back — equal table
for table (the re-export's files byte for byte), served by the explorer as the original was; and refused,
with the file and the reason and nothing written, when the export is truncated, tampered, from a newer
format, of a model here with other weights, or already imported."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from typer.testing import CliRunner

from ffmem.cli import cli
from ffmem.config import Settings
from ffmem.store import bulk
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.export import TABLES
from ffmem.store.models import LanguageModel, Run
from ffmem.web.main import create_app

pytestmark = pytest.mark.backends("sqlite", "postgres")

# Tables a run fills: the model's and corpus's are shared, so the re-export of a run holds the same rows.
RESULTS = [exported.name for exported in TABLES]


def _invoke(*args: str):
    return CliRunner().invoke(cli, [*map(str, args)])


def _export(url: str, run_id: int, folder, fmt: str = "parquet") -> dict:
    result = _invoke("export", run_id, "--format", fmt, "--out", folder, "--db", url)
    assert result.exit_code == 0, result.output
    return json.loads((folder / "manifest.json").read_text())


def _counts(url: str) -> dict[str, int]:
    """Rows per exported table in the database at `url`."""
    engine = make_engine(url)
    with engine.connect() as connection:
        counts = {e.name: connection.scalar(select(func.count()).select_from(e.table)) for e in TABLES}
    engine.dispose()
    return counts


def _page(url: str, path: str) -> dict:
    app = create_app(Settings(database_url=url))
    with TestClient(app) as client:
        response = client.get(path)
    app.state.engine.dispose()
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_run_moves_to_the_other_backend_and_back_unchanged(
    explorer_db, run, slug, tmp_path, fmt, migrated_template, postgres_databases
):
    from conftest import copy_database

    source = explorer_db.split(":")[0].split("+")[0]
    other = "postgres" if source == "sqlite" else "sqlite"
    first = _export(explorer_db, run.id, tmp_path / "first", fmt)
    (tmp_path / "there").mkdir()
    (tmp_path / "back").mkdir()
    with (
        copy_database(migrated_template(other), tmp_path / "there", postgres_databases) as there,
        copy_database(migrated_template(source if source == "sqlite" else "postgres"), tmp_path / "back",
                      postgres_databases) as back,
    ):  # fmt: skip
        result = _invoke("import", tmp_path / "first", "--db", there)
        assert result.exit_code == 0, result.output
        assert f"imported {tmp_path / 'first'} as run 1 of {slug}: " in result.output
        counts = _counts(there)
        assert counts == {name: first["files"][f"{name}.{fmt}"]["rows"] for name in RESULTS}
        second = _export(there, 1, tmp_path / "second", fmt)
        assert _invoke("import", tmp_path / "second", "--db", back).exit_code == 0
        third = _export(back, 1, tmp_path / "third", fmt)
        # After one pass through Postgres (its 4-byte statistics) every table is identical, byte for byte.
        assert second["files"] == third["files"]
        # Before it, only the statistics differ: SQLite's 8-byte floats rounded to Postgres's 4-byte reals.
        moved = {} if source == "postgres" else {f"key_stats.{fmt}"}
        assert {n: f for n, f in first["files"].items() if n not in moved} == {
            n: f for n, f in second["files"].items() if n not in moved
        }
        for name in moved:
            before, after = _rows(tmp_path / "first" / name), _rows(tmp_path / "second" / name)
            assert [_float32(row) for row in before] == [_float32(row) for row in after]
        # The explorer serves the imported run as it served the original.
        for path in (
            f"/m/{slug}/layers/1/keys/4.json", f"/m/{slug}/layers/1/keys/4/samples.json",
            f"/m/{slug}/layers/1/keys/4/related.json", f"/m/{slug}/layers/2/keys/7/quadrants/pn.json",
            f"/m/{slug}/layers/2.json", f"/m/{slug}/analysis.json", f"/m/{slug}/search.json?q=Paris",
            f"/m/{slug}/search.json?token=+Paris", f"/m/{slug}.json",
        ):  # fmt: skip
            _same(_page(there, path), _page(explorer_db, path))


def _rows(path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _float32(row: dict) -> dict:
    """A row's floats as 4-byte reals (Postgres gives back a real's shortest decimal, not its exact value)."""
    return {name: float(np.float32(v)) if isinstance(v, float) else v for name, v in row.items()}


def _same(a, b) -> None:
    """Two pages' JSON equal but for their times and the link to a random memory, floats to float32's
    precision (Postgres stores some statistics as 4-byte reals)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b)
        for name in a:
            if not name.endswith(("_at", "seconds", "random")):
                _same(a[name], b[name])
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-5)
    else:
        assert a == b


def test_refusals_name_the_file_and_write_nothing(explorer_db, run, tmp_path, db_url):
    folder = tmp_path / "export"
    manifest = _export(explorer_db, run.id, folder, "jsonl")
    empty = _counts(db_url)

    def refused(expected: str) -> None:
        result = _invoke("import", folder, "--db", db_url)
        assert result.exit_code == 2 and f"error: {expected}" in result.output, result.output
        assert _counts(db_url) == empty

    original = (folder / "key_stats.jsonl").read_bytes()
    (folder / "key_stats.jsonl").write_bytes(original[: len(original) // 2])  # truncated
    refused(f"{folder / 'key_stats.jsonl'}: checksum differs from the manifest's (truncated or changed)")
    (folder / "key_stats.jsonl").write_bytes(original.replace(b'"layer":0', b'"layer":1', 1))  # tampered
    refused(f"{folder / 'key_stats.jsonl'}: checksum differs from the manifest's (truncated or changed)")
    (folder / "key_stats.jsonl").unlink()
    refused(f"{folder / 'key_stats.jsonl'}: missing")
    (folder / "key_stats.jsonl").write_bytes(original)
    (folder / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))
    newer = "export format version 2 is newer than this ffmem reads (1); upgrade ffmem"
    refused(f"{folder / 'manifest.json'}: {newer}")
    (folder / "manifest.json").write_text(json.dumps({**manifest, "files": {}}))
    refused(f"{folder / 'manifest.json'}: lists no language_models.jsonl")
    (folder / "manifest.json").write_text("{")
    refused(f"{folder / 'manifest.json'}: not JSON")
    (folder / "manifest.json").unlink()
    refused(f"{folder / 'manifest.json'}: missing; not an ffmem export folder")


def test_a_write_that_fails_midway_leaves_nothing(explorer_db, run, tmp_path, db_url, monkeypatch):
    folder = tmp_path / "export"
    _export(explorer_db, run.id, folder)
    empty = _counts(db_url)
    real = bulk.bulk_insert

    def failing(session, table, columns, rows):
        if table.name == "explanations":  # after the model, corpus, run and most results are written
            raise RuntimeError("disk full")
        real(session, table, columns, rows)

    monkeypatch.setattr(bulk, "bulk_insert", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        CliRunner().invoke(cli, ["import", str(folder), "--db", db_url], catch_exceptions=False)
    assert _counts(db_url) == empty


def test_a_model_here_gets_a_run_more_and_the_same_run_twice_adds_nothing(explorer_db, run, tmp_path, db_url):
    folder = tmp_path / "export"
    _export(explorer_db, run.id, folder)
    assert _invoke("import", folder, "--db", db_url).exit_code == 0
    once = _counts(db_url)
    result = _invoke("import", folder, "--db", db_url)
    assert result.exit_code == 2
    assert "error: already imported: run 1 of this database is this run; nothing added" in result.output
    assert _counts(db_url) == once
    # Another run of the same model and corpus (another start): a run more, the vocabulary and corpus shared.
    engine = make_engine(db_url)
    with make_sessionmaker(engine)() as session:
        session.get(Run, 1).started_at = session.get(Run, 1).started_at.replace(year=2020)
        session.commit()
    engine.dispose()
    result = _invoke("import", folder, "--db", db_url)
    assert result.exit_code == 0, result.output
    assert "as run 2 of " in result.output and "(the model and corpus already here)" in result.output
    twice = _counts(db_url)
    assert twice["runs"] == 2 and twice["memory_lists"] == 2 * once["memory_lists"]
    assert (twice["tokens"], twice["sentences"], twice["labels"]) == (
        once["tokens"], once["sentences"], once["labels"],
    )  # fmt: skip


def test_a_model_here_with_other_weights_is_refused(explorer_db, run, tmp_path, db_url):
    folder = tmp_path / "export"
    _export(explorer_db, run.id, folder)
    assert _invoke("import", folder, "--db", db_url).exit_code == 0
    engine = make_engine(db_url)
    with make_sessionmaker(engine)() as session:
        model = session.scalars(select(LanguageModel)).one()
        theirs, model.revision = model.revision, "0" * 64
        slug = model.slug
        session.commit()
    engine.dispose()
    before = _counts(db_url)
    result = _invoke("import", folder, "--db", db_url)
    assert result.exit_code == 2
    assert (
        f"error: model {slug} is already here with other weights (revision {'0' * 64} here, {theirs} in the "
        "export); import into another database"
    ) in result.output.replace("\n", "")
    assert _counts(db_url) == before
    # The same revision, but the weights its runs recorded differ (their provenance's checksum).
    engine = make_engine(db_url)
    with make_sessionmaker(engine)() as session:
        session.scalars(select(LanguageModel)).one().revision = theirs
        stored = session.get(Run, 1)
        recorded = stored.provenance["weights_sha256"]
        stored.provenance = {**stored.provenance, "weights_sha256": "1" * 64}
        session.commit()
    engine.dispose()
    result = _invoke("import", folder, "--db", db_url)
    assert result.exit_code == 2
    assert (
        f"error: model {slug} is already here with other weights (weights sha256 {'1' * 64} here, "
        f"{recorded} in the export); import into another database"
    ) in result.output.replace("\n", "")
    assert _counts(db_url) == before


def test_an_import_into_a_new_database_creates_its_tables_first(explorer_db, run, tmp_path):
    """`ffmem import --db sqlite:///new.db`: a database that does not exist yet gets ffmem's tables, then the
    run (as `ffmem index` migrates before it writes); an export from a file that holds no ffmem tables says
    there is no such run, in one line."""
    _export(explorer_db, run.id, tmp_path / "out")
    new = f"sqlite:///{tmp_path / 'new.db'}"
    result = _invoke("import", tmp_path / "out", "--db", new)
    assert result.exit_code == 0, result.output
    assert _counts(new) == _counts(explorer_db)
    empty = _invoke("export", 1, "--out", tmp_path / "none", "--db", f"sqlite:///{tmp_path / 'empty.db'}")
    assert (empty.exit_code, empty.output) == (2, "error: there is no run 1\n")
